"""The ``atoll`` command line: user-facing output lives here and nowhere else."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from node.config import ConfigError, load_config

__all__ = ["main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (defaults when omitted)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set sync.codec=int8 (repeatable)",
    )


def _cmd_simulate(args: argparse.Namespace) -> int:
    from node.simulate import simulate

    overrides = list(args.overrides)
    if args.inner_steps is not None:
        overrides.append(f"sync.inner_steps={args.inner_steps}")
    if args.codec is not None:
        overrides.append(f"sync.codec={json.dumps(args.codec)}")
    if args.fragments is not None:
        overrides.append(f"sync.fragments={args.fragments}")
    cfg = load_config(args.config, overrides)
    total = args.rounds * cfg.sync.inner_steps
    if cfg.train.total_steps != total:
        cfg = cfg.replace(train={"total_steps": total})

    def progress(entry: dict[str, Any]) -> None:
        loss = entry.get("loss", float("nan"))
        print(
            f"round {entry['round']:>3}/{args.rounds}  val_bpb {entry['val_bpb']:.3f}  "
            f"train_loss {loss:.3f}  tokens {entry['tokens']:>9}  "
            f"{entry.get('seconds', 0.0):6.1f}s",
            file=sys.stderr if args.json else sys.stdout,
            flush=True,
        )

    result = simulate(cfg, replicas=args.replicas, rounds=args.rounds, progress=progress)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"done: {result['replicas']} replicas, {result['rounds']} rounds, val bits/byte "
            f"{result['val_bpb_start']:.3f} -> {result['val_bpb_end']:.3f} "
            f"in {result['seconds']:.0f}s"
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atoll", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate", help="train K DiLoCo replicas in one process (the algorithmic reference)"
    )
    _add_config_args(sim)
    sim.add_argument("--replicas", type=int, default=4)
    sim.add_argument("--inner-steps", type=int, default=None, help="H (sync.inner_steps)")
    sim.add_argument("--rounds", type=int, default=6)
    sim.add_argument("--fragments", type=int, default=None, help="sync.fragments")
    sim.add_argument("--codec", default=None, help="none, fp16, bf16, int8 or int4")
    sim.add_argument("--json", action="store_true", help="last line: one JSON summary")
    sim.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``atoll`` console script."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except (ConfigError, ValueError) as exc:
        print(f"atoll: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("atoll: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
