"""What comes before a run: ``atoll data prepare`` (a corpus as token shards),
``atoll keygen`` (a node's identity), ``atoll spec`` (a signed run spec) and
``atoll plan`` (what a run's links will carry)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.cli.errors import file_problem
from node.config import load_config

if TYPE_CHECKING:
    from node.config import AtollConfig

__all__ = ["cmd_data_prepare", "cmd_keygen", "cmd_plan", "cmd_spec_create", "cmd_spec_show"]


# ---- data prepare ---------------------------------------------------------------------------


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """``atoll data prepare``: tokenize a corpus into shards, resumable."""
    import signal

    from node.data.prepare import Interrupted, prepare

    _check_prepare_options(args)
    out = Path(args.out).expanduser()

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with _progress_bar("tokenizing", "documents") as progress:
        try:
            meta = prepare(
                args.paths,
                out,
                tokenizer=args.tokenizer,
                train_vocab=args.vocab_size if args.train_tokenizer else None,
                field=args.field,
                column=args.column,
                eos=args.eos,
                val_fraction=args.val_fraction,
                workers=args.workers,
                piece_mb=args.piece_mb,
                force=args.force,
                progress=progress,
            )
        except Interrupted as exc:
            print(f"atoll: {exc}", file=sys.stderr)
            return 130
    per = meta.get("bytes_per_token", 1.0)
    tok = meta.get("tokenizer") or {}
    what = (
        "bytes"
        if tok.get("digest") == "bytes"
        else f"vocabulary {meta['vocab_size']}, {per:.2f} bytes per token; tokenizer in "
        f"{out / 'tokenizer'}"
    )
    print(
        f"wrote {out}: {meta['train_tokens']} train and {meta['val_tokens']} validation "
        f"tokens ({meta['dtype']}, {what}) from {meta['files']} files; train on them with "
        f"--set data.shards={json.dumps(str(out))}"
    )
    return 0


def _check_prepare_options(args: argparse.Namespace) -> None:
    if args.vocab_size is not None and not args.train_tokenizer:
        raise ValueError("--vocab-size is the size of a tokenizer to train: add --train-tokenizer")
    if args.train_tokenizer and args.vocab_size is None:
        raise ValueError("--train-tokenizer needs --vocab-size N (e.g. 8192)")
    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    if not args.piece_mb > 0:
        raise ValueError("--piece-mb must be > 0")


class _progress_bar:  # noqa: N801 - used as a context manager, like a function
    """A rich progress bar on stderr when it is a terminal, else nothing; the object it
    yields is called with (done, total)."""

    def __init__(self, what: str, unit: str) -> None:
        self.what, self.unit = what, unit
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not sys.stderr.isatty():
            return None
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(file=sys.stderr), transient=True)
        self.bar.start()
        task = self.bar.add_task(f"{self.what} ({self.unit})", total=None)
        return lambda done, total: self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- keygen ---------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    """``atoll keygen``: this node's Ed25519 identity key (kept when it exists)."""
    from verification.errors import VerificationError
    from verification.identity import Identity

    path = Path(args.out) if args.out else Path(args.data_dir).expanduser() / "identity.key"
    if path.exists() and not args.force:
        try:
            identity = Identity.load(path)
        except (VerificationError, IsADirectoryError) as exc:
            detail = getattr(exc, "detail", "a directory").removeprefix(f"{path}: ")
            raise ValueError(
                f"{path} is not a valid identity key ({detail}); restore it from a backup, "
                "or pass --force to replace it (the node gets a new PeerID)"
            ) from exc
        print(f"{path} already exists (use --force to replace); PeerID {identity.peer_id}")
        return 0
    _private_dir(path.parent)
    identity = Identity.generate()
    try:
        identity.save(path)
    except OSError as exc:
        raise ValueError(file_problem(exc, path.parent)) from exc
    print(f"wrote {path}; PeerID {identity.peer_id}")
    return 0


def _private_dir(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700 (they hold keys)."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
        d.chmod(0o700)  # a umask narrower than 077 could leave the owner locked out


# ---- spec -----------------------------------------------------------------------------------


def cmd_spec_create(args: argparse.Namespace) -> int:
    """``atoll spec create``: sign a config's shared settings into a run spec."""
    from node.spec import create_spec, version_line
    from node.spec_file import read_spec, write_spec
    from node.swarm.join import run_addresses
    from node.train.bindings import bind
    from protocol.p2p.addrs import with_peer_id
    from verification.errors import VerificationError
    from verification.identity import Identity

    previous = read_spec(args.previous) if args.previous else None
    # the spec binds what the model config, first weights and tokenizer hold
    cfg = bind(load_config(args.config, args.overrides))
    key = Path(args.key) if args.key else Path(args.data_dir).expanduser() / "identity.key"
    created = not key.exists()
    try:
        _private_dir(key.parent)
        identity = Identity.load_or_create(key)
    except (OSError, VerificationError) as exc:
        raise ValueError(f"identity key {key}: {exc}") from None
    if created:
        print(f"created identity key {key}; PeerID {identity.peer_id}")
    # The creator usually runs the bootstrap node: an address without /p2p/ is its own.
    bootstrap = [with_peer_id(m, identity.peer_id) for m in args.bootstrap]
    spec = create_spec(cfg, identity, bootstrap=bootstrap, t0=args.t0, previous=previous)
    write_spec(spec, args.out, force=args.force)
    print(f"wrote {args.out}: run {spec.run_id}, spec {spec.short}, creator {spec.creator}")
    if previous is not None:
        print(version_line(spec))
        print(
            "nodes take it when restarted on it (atoll run --spec FILE, or atoll join once "
            "the bootstrap node runs it); nodes of the two versions refuse each other"
        )
    if spec.t0 is not None:
        print(f"round 1 starts at {_utc(spec.t0)} (t0 {spec.t0})")
    if not spec.bootstrap:
        print("no --bootstrap given: volunteers must pass --initial-peers to find the run")
    addresses = run_addresses(spec)
    for address in addresses:
        print(f"run address: {address}")
    from_file = f"atoll run --spec {shlex.quote(args.out)} --operator {spec.creator}"
    if addresses:
        # the bootstrap node serves the spec it runs, so volunteers fetch it from there
        print(f"start the bootstrap node with: atoll run --spec {shlex.quote(args.out)}")
        print(f"volunteers join with: atoll join {shlex.quote(str(addresses[0]))}")
        print(f"or, from a copy of the file: {from_file}")
    else:
        print(f"volunteers join with: {from_file}")
    return 0


def cmd_spec_fetch(args: argparse.Namespace) -> int:
    """``atoll spec fetch``: a run's spec from its address, verified, written to a file."""
    from node.spec import SpecError
    from node.swarm.join import RunAddress, fetch_spec, save_spec

    address = RunAddress.parse(args.address)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SpecError(f"run spec {out}: already exists (use --force to replace it)")
    spec, raw = fetch_spec(address, args.operator, host=args.host)
    save_spec(raw, out)
    print(f"wrote {out}: run {spec.run_id}, spec {spec.short}, signed by {spec.creator}")
    print(f"run it with: atoll run --spec {shlex.quote(str(out))} --operator {spec.creator}")
    return 0


def _utc(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_spec_show(args: argparse.Namespace) -> int:
    """``atoll spec show``: verify a run spec and print it."""
    import base64

    from node.spec_file import read_spec

    spec = read_spec(args.file)  # verifies the signature
    if args.json:
        fields = {
            "run_id": spec.run_id,
            "digest": spec.digest,
            "protocol": spec.protocol,
            "creator": spec.creator,
            "created": spec.created,
            "t0": spec.t0,
            "bootstrap": list(spec.bootstrap),
            "shared": spec.shared,
            "signature": base64.b64encode(spec.signature).decode("ascii"),
            "versions": [
                {"digest": v.digest, "creator": v.creator, "created": v.created}
                for v in spec.chain()
            ],
        }
        print(json.dumps(fields))
        return 0
    print(f"run spec {args.file}: signature OK")
    print(f"  run id     {spec.run_id}")
    print(f"  digest     {spec.digest}")
    print(f"  creator    {spec.creator}")
    print(f"  created    {spec.created}")
    print(f"  protocol   {spec.protocol}")
    t0 = f"{spec.t0} ({_utc(spec.t0)})" if spec.t0 is not None else "none (steps trigger)"
    print(f"  t0         {t0}")
    print(f"  bootstrap  {' '.join(spec.bootstrap) or 'none'}")
    chain = spec.chain()
    signers = ", ".join(dict.fromkeys(spec.signers))
    print(f"  version    {len(chain)}; the next may be signed by {signers}")
    for older in chain[1:]:
        print(f"  replaces   spec {older.short} by {older.creator} ({older.created})")
    print("shared settings")
    for section, values in spec.shared.items():
        for key, value in values.items():
            print(f"  {section}.{key} = {json.dumps(value)}")
    return 0


# ---- plan -----------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    """``atoll plan``: bytes, link time and utilization of a run's syncs."""
    from node.ops.plan import PlanInput, describe, parse_count, plan

    # what the command line gives replaces the config's, and is checked as the config is
    given = {
        "sync.codec": args.codec,
        "sync.fragments": args.fragments,
        "sync.trigger": args.trigger,
        "sync.inner_steps": args.inner_steps,
        "sync.round_seconds": args.round_seconds,
        "sync.tau": args.tau,
        "network.group_size": args.group_size,
    }
    overrides = [f"{k}={json.dumps(v)}" for k, v in given.items() if v is not None]
    cfg = load_config(args.config, [*args.overrides, *overrides])
    params = parse_count(args.params) if args.params is not None else _model_params(cfg)
    sync = cfg.sync
    inp = PlanInput(
        params=params,
        bandwidth_gbit=args.bandwidth_gbit,
        step_seconds=args.step_seconds,
        codec=sync.codec,
        block_size=sync.chunk,
        topk_k=sync.codec_args().get("k", 0),
        topk_bits=sync.topk_bits if sync.codec == "topk" else 0,
        fragments=sync.fragments,
        group_size=cfg.network.group_size,
        trigger=sync.trigger,
        inner_steps=sync.inner_steps,
        round_seconds=sync.round_seconds if sync.trigger == "seconds" else None,
        tau=sync.tau,
        distance_km=args.distance_km,
        round_trips=args.round_trips,
        overhead_seconds=args.overhead_seconds,
    )
    result = plan(inp)
    print(json.dumps(result) if args.json else describe(result))
    return 0


def _model_params(cfg: AtollConfig) -> int:
    """The parameters of the config's model, counted without allocating them."""
    import torch

    from node.train.bindings import bind
    from node.train.model import build_model

    model_cfg = bind(cfg).model  # a preset's vocabulary: the tokenizer's
    with torch.device("meta"):  # counted, not allocated: a 1B model costs nothing
        model = build_model(model_cfg)
    return sum(p.numel() for p in model.parameters())
