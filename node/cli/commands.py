"""The table of ``atoll``'s commands: each command's help, arguments and the function
that runs it (``module:function`` under :mod:`node.cli`), in the order ``atoll --help``
lists them (those that prepare a run are in :mod:`node.cli.preparing_commands`, the
arguments several share in :mod:`node.cli.arguments`). :func:`atoll_parser` turns it into
the parser (:mod:`node.cli.parser`).
"""

from __future__ import annotations

import argparse

from node.cli.arguments import CONFIG, DATA_DIR, ROUND
from node.cli.parser import Arg, Command, Group, arg, build_parser
from node.cli.preparing_commands import DATA, KEYGEN, PLAN, SPEC
from node.swarm.fault_modes import ALL_MODES as _BYZANTINE_MODES

__all__ = ["COMMANDS", "atoll_parser"]

_DESCRIPTION = (
    "Atoll: train one model across scattered machines. Run a node (atoll run), join "
    "a public run from its address (atoll join), "
    "try a swarm on this machine (atoll swarm), and watch and manage a node "
    "(status, peers, ban, pardon, audit, export); prepare a large corpus (data) "
    "and plan a run's links (plan)."
)

_GLOBAL = (
    arg("-v", "--verbose", action="store_true", help="debug logging"),
    arg(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text, or one JSON object each (for log shippers)",
    ),
)

_AUDIT = (DATA_DIR, arg("--json", action="store_true", help="JSON instead of a table"))


def _operator(reason: str | None) -> tuple[Arg, ...]:
    """``atoll ban`` and ``atoll pardon``: a reason is required where it has no default."""
    return (
        arg("peer", help="the peer's PeerID"),
        arg(
            "--reason",
            required=reason is None,
            default=reason,
            help="why (recorded in the audit log)",
        ),
        DATA_DIR,
        arg("--timeout", type=float, default=20.0, help="seconds to wait for a running node"),
    )


_SIMULATE = Command(
    "simulate",
    "train K DiLoCo replicas in one process (the algorithmic reference)",
    "running:cmd_simulate",
    (
        *CONFIG,
        arg("--replicas", type=int, default=4, help="K, the number of replicas"),
        arg("--inner-steps", type=int, help="H (sync.inner_steps)"),
        arg("--rounds", type=int, default=6, help="outer rounds to train"),
        arg("--fragments", type=int, help="sync.fragments"),
        arg("--codec", help="none, fp16, bf16, int8, int4 or topk"),
        arg("--json", action="store_true", help="last line: one JSON summary"),
    ),
)

_NODE_ARGS = (
    arg("--data-dir", help="run.data_dir (key, checkpoints, logs)"),
    arg(
        "--rounds",
        type=int,
        help="stop after this round of the run (run.max_rounds; a node joining later stops "
        "at the same round)",
    ),
    arg(
        "--slowdown",
        type=float,
        metavar="X",
        help="run X times slower than this hardware (stands in for a slower machine)",
    ),
    arg(
        "--byzantine",
        metavar="MODE",
        help="fault injection for tests and benchmarks: " + ", ".join(_BYZANTINE_MODES),
    ),
    arg(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="run this node as a site of N processes (torchrun; gloo on CPU, NCCL on "
        "GPUs): rank 0 joins the swarm, all N train data-parallel",
    ),
    arg(
        "--log-file",
        metavar="PATH",
        help="where the node logs besides stderr, rotated at 10 MiB (default "
        "DATA_DIR/node.log; - for none)",
    ),
)
"""Options of every command that runs a node (``run`` and ``join``)."""

_RUN = Command(
    "run",
    "run one training node",
    "running:cmd_run",
    (
        *CONFIG,
        arg(
            "--initial-peers",
            nargs="*",
            default=[],
            metavar="MADDR",
            help="multiaddrs to join through",
        ),
        *_NODE_ARGS,
        arg(
            "--spec",
            metavar="FILE",
            help="join the run this signed spec describes (atoll spec create makes one)",
        ),
        arg(
            "--join",
            metavar="ADDRESS",
            help="join the run at this address (RUN_ID@MULTIADDR): as atoll join ADDRESS",
        ),
        arg(
            "--operator",
            metavar="PEERID",
            help="refuse a --spec (or a --join's spec) not signed by this PeerID (the run's "
            "operator gives it out, so that a copy signed by someone else is not joined)",
        ),
    ),
)

_JOIN = Command(
    "join",
    "join a run from its address (fetch the operator's signed spec from the swarm, then run)",
    "running:cmd_join",
    (
        arg(
            "address",
            help="the run address the operator gives out, RUN_ID@MULTIADDR (atoll spec "
            "create prints it)",
        ),
        *CONFIG,
        *_NODE_ARGS,
        arg(
            "--operator",
            metavar="PEERID",
            help="the PeerID that must have signed the spec (default: the address's, "
            "for an address through another node of the run)",
        ),
    ),
)

_SWARM = Command(
    "swarm",
    "run N real nodes on 127.0.0.1 with a live view",
    "running:cmd_swarm",
    (
        *CONFIG,
        arg("--nodes", type=int, default=4, help="how many nodes to start"),
        arg("--rounds", type=int, help="rounds per node (run.max_rounds)"),
        arg("--dir", help="swarm directory (default .atoll/swarm-TIME)"),
        arg("--json", action="store_true", help="last line: one JSON summary"),
        arg(
            "--procs-per-node",
            type=int,
            default=1,
            metavar="P",
            help="run each node as a site of P processes (torchrun, gloo inside the site)",
        ),
        arg("--slowdowns", metavar="X,X,...", help="per-node slowdown factors, e.g. 1,1,2,4"),
        arg(
            "--byzantine",
            metavar="MODE[:K]",
            help="make the last K nodes (default 1) faulty in MODE, for tests and benchmarks",
        ),
    ),
)

_AUDIT_GROUP = Group(
    "audit",
    "inspect a node's hash-chained audit log",
    "audit_command",
    (
        Command(
            "verify",
            "check the hash chain; exit 1 and name the first bad row if broken",
            "auditing:cmd_audit",
            _AUDIT,
        ),
        Command(
            "show",
            "list audit rows",
            "auditing:cmd_audit",
            (
                *_AUDIT,
                arg("--round", type=int, help="only rows of this round"),
                arg("--peer", help="only rows of this sender (whole or ...shortened)"),
                arg("--limit", type=int, help="at most this many rows"),
            ),
        ),
        Command(
            "blame",
            "whose contributions are in the model at a round",
            "auditing:cmd_audit",
            (*_AUDIT, arg("--round", type=int, required=True, help="the training round")),
        ),
    ),
)

_WATCH = (
    Command(
        "status",
        "the swarm as a node sees it from heartbeats",
        "operating:cmd_status",
        (DATA_DIR, arg("--json", action="store_true", help="the node's whole status as JSON")),
    ),
    Command(
        "peers",
        "every peer this node has judged: score, standing",
        "operating:cmd_peers",
        (DATA_DIR, arg("--json", action="store_true", help="one JSON list")),
    ),
    Command(
        "ban", "exclude a peer for good (until pardoned)", "operating:cmd_operator", _operator(None)
    ),
    Command(
        "pardon",
        "lift a peer's ban or quarantine",
        "operating:cmd_operator",
        _operator("pardoned by the operator"),
    ),
)

_MODEL = (
    Command(
        "export",
        "write the agreed global parameters of a checkpoint: a from_pretrained folder "
        "(--format hf) or one safetensors file",
        "model:cmd_export",
        (
            DATA_DIR,
            arg(
                "--out",
                required=True,
                help="the folder (--format hf) or .safetensors file to write",
            ),
            arg(
                "--format",
                choices=("atoll", "hf"),
                default="atoll",
                help="hf: a folder transformers loads (config, model.safetensors, tokenizer); "
                "atoll: the parameters under the model's own names (default)",
            ),
            ROUND,
            arg("--force", action="store_true", help="replace a non-empty --out folder"),
        ),
    ),
    Command(
        "sample",
        "print a continuation of a prompt from the agreed global parameters",
        "model:cmd_sample",
        (
            DATA_DIR,
            arg("--prompt", default="", help="the text to continue"),
            arg("--max-tokens", type=int, default=100, help="tokens to generate (default 100)"),
            arg(
                "--temperature",
                type=float,
                default=0.8,
                help="sampling temperature; 0: the likeliest token",
            ),
            arg("--top-k", type=int, default=50, help="sample among the k likeliest tokens"),
            arg("--seed", type=int, default=0, help="seed of the sampling"),
            ROUND,
        ),
    ),
)

COMMANDS: tuple[Command | Group, ...] = (
    _SIMULATE,
    _RUN,
    _JOIN,
    _SWARM,
    _AUDIT_GROUP,
    *_WATCH,
    *_MODEL,
    PLAN,
    DATA,
    KEYGEN,
    SPEC,
)
"""Every command, in the order ``atoll --help`` lists them."""


def atoll_parser() -> argparse.ArgumentParser:
    """The ``atoll`` parser: global options, ``--version`` and :data:`COMMANDS`."""
    version = arg("--version", action="version", version=f"atoll {_version()}")
    return build_parser("atoll", _DESCRIPTION, (*_GLOBAL, version), COMMANDS)


def _version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare source tree)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("atoll")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
