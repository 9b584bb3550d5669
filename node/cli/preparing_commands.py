"""The table entries of the commands that prepare a run, run by :mod:`node.cli.preparing`:
``atoll plan`` (a run's links before it starts), ``atoll data`` (a corpus as token
shards), ``atoll keygen`` and ``atoll spec`` (a signed run spec).
"""

from __future__ import annotations

import os

from node.cli.arguments import CONFIG, DATA_DIR
from node.cli.parser import Command, Group, arg

__all__ = ["DATA", "KEYGEN", "PLAN", "SPEC"]

PLAN = Command(
    "plan",
    "bytes, link time and utilization of a run's syncs, before starting it",
    "preparing:cmd_plan",
    (
        *CONFIG,
        arg("--params", help="model size, e.g. 1T, 7B, 480k (default: the config's)"),
        arg("--codec", help="none, fp16, bf16, int8, int4 or topk (default: the config's)"),
        arg("--fragments", type=int, help="fragments (default: the config's)"),
        arg("--group-size", type=int, help="butterfly group size (default: the config's)"),
        arg("--trigger", choices=("steps", "seconds"), help="sync.trigger (default: the config's)"),
        arg("--inner-steps", type=int, help="H, inner steps per round (default: the config's)"),
        arg("--round-seconds", type=float, help="round length with --trigger seconds"),
        arg("--tau", type=int, help="steps before a result is applied (default: the config's)"),
        arg("--step-seconds", type=float, required=True, help="seconds one inner step takes"),
        arg("--bandwidth-gbit", type=float, required=True, help="each node's link, Gbit/s"),
        arg("--distance-km", type=float, default=0.0, help="distance between sites, km"),
        arg("--round-trips", type=int, default=2, help="round trips a sync waits for (default 2)"),
        arg(
            "--overhead-seconds",
            type=float,
            default=0.0,
            help="fixed seconds per sync besides the link (matchmaking; 0.58 measured on loopback)",
        ),
        arg("--json", action="store_true", help="print the plan as JSON"),
    ),
)

DATA = Group(
    "data",
    "prepare a corpus as token shards read through memory maps",
    "data_command",
    (
        Command(
            "prepare",
            "tokenize text, .jsonl or .parquet files into shards (train.bin, val.bin, "
            "meta.json) for data.shards",
            "preparing:cmd_data_prepare",
            (
                arg(
                    "paths",
                    nargs="+",
                    metavar="PATH",
                    help="files or globs (quote ** globs): text (a document each), .jsonl, .parquet",
                ),
                arg("--out", required=True, help="directory to write the shards to"),
                arg(
                    "--val-fraction",
                    type=float,
                    default=0.1,
                    help="share held out for validation (files by a hash of their path as "
                    "bytes, documents by a hash of their text)",
                ),
                arg(
                    "--tokenizer",
                    metavar="PATH",
                    help="a tokenizer.json or a tokenizer folder (loaded offline)",
                ),
                arg(
                    "--train-tokenizer",
                    action="store_true",
                    help="train a byte-level BPE on the corpus (saved in OUT/tokenizer)",
                ),
                arg("--vocab-size", type=int, metavar="N", help="tokens of the BPE to train"),
                arg("--field", default="text", help="the text field of .jsonl lines"),
                arg("--column", default="text", help="the text column of .parquet files"),
                arg(
                    "--eos",
                    metavar="TOKEN",
                    help="the end-of-document token (default: the tokenizer's)",
                ),
                arg(
                    "--workers",
                    type=int,
                    default=max(1, min(8, os.cpu_count() or 1)),
                    help="tokenizing processes (default: the cores, at most 8)",
                ),
                arg(
                    "--piece-mb",
                    type=float,
                    default=16.0,
                    help="MiB of text per unit of work: what an interruption can lose (default 16)",
                ),
                arg("--force", action="store_true", help="replace shards already in --out"),
            ),
            description="Without a tokenizer, text files are copied as bytes (the byte "
            "model's tokens); with --tokenizer or --train-tokenizer, or from .jsonl/.parquet, "
            "each document is tokenized and ends with the tokenizer's EOS token. An "
            "interrupted prepare resumes when the same command runs again.",
        ),
    ),
)

KEYGEN = Command(
    "keygen",
    "create this node's Ed25519 identity key",
    "preparing:cmd_keygen",
    (
        DATA_DIR,
        arg("--out", help="key file (default DATA_DIR/identity.key)"),
        arg("--force", action="store_true", help="replace an existing key"),
    ),
)

SPEC = Group(
    "spec",
    "create or inspect a signed run spec",
    "spec_command",
    (
        Command(
            "create",
            "sign a config's shared settings into a run spec for volunteers to join",
            "preparing:cmd_spec_create",
            (
                *CONFIG,
                arg(
                    "--bootstrap",
                    action="append",
                    default=[],
                    metavar="MADDR",
                    help="multiaddr ending in /p2p/<peer id> that joining nodes dial (repeatable)",
                ),
                arg("--key", help="signing key (default DATA_DIR/identity.key, made if missing)"),
                arg("--data-dir", default=".atoll/node", help="where the default key lives"),
                arg(
                    "--t0",
                    type=float,
                    metavar="UNIX_TIME",
                    help="round 1's start for sync.trigger = seconds (default: a round "
                    "boundary >= 60 s ahead; a new version keeps its previous one's)",
                ),
                arg(
                    "--previous",
                    metavar="FILE",
                    help="the run's current spec: make its next version (same run, signed "
                    "by its creator or one of its run.spec_signers)",
                ),
                arg("--out", required=True, help="spec file to write, e.g. run.toml"),
                arg("--force", action="store_true", help="replace an existing file"),
            ),
        ),
        Command(
            "fetch",
            "fetch a run's signed spec from its address and verify it",
            "preparing:cmd_spec_fetch",
            (
                arg("address", help="the run address, RUN_ID@MULTIADDR"),
                arg("--out", required=True, help="spec file to write, e.g. run.toml"),
                arg(
                    "--operator",
                    metavar="PEERID",
                    help="the PeerID that must have signed it (default: the address's)",
                ),
                arg("--host", default="127.0.0.1", help="IP address to listen on meanwhile"),
                arg("--force", action="store_true", help="replace an existing file"),
            ),
        ),
        Command(
            "show",
            "verify a run spec and print it",
            "preparing:cmd_spec_show",
            (
                arg("file", help="the spec file"),
                arg("--json", action="store_true", help="the spec as one JSON object"),
            ),
        ),
    ),
)
