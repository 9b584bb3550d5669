"""``atoll simulate``, ``atoll run`` and ``atoll swarm``: training, in one process, as one
node, or as a swarm of real nodes on this machine."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from node.cli.errors import file_problem
from node.cli.logs import log_file
from node.config import ConfigError, load_config
from node.fault_modes import parse_mode

if TYPE_CHECKING:
    from node.daemon import Node
    from node.swarm import SwarmProcess, SwarmSpec

__all__ = ["cmd_run", "cmd_simulate", "cmd_swarm", "initial_peers"]


def cmd_simulate(args: argparse.Namespace) -> int:
    """``atoll simulate``: K DiLoCo replicas in one process, round by round."""
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


def cmd_run(args: argparse.Namespace) -> int:
    """``atoll run``: one training node (or, under torchrun, one rank of a site)."""
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"run.data_dir={json.dumps(args.data_dir)}")
    if args.rounds is not None:
        overrides.append(f"run.max_rounds={args.rounds}")
    if args.slowdown is not None:
        overrides.append(f"run.slowdown={args.slowdown}")
    spec = None
    if args.operator and not args.spec:
        raise ValueError("--operator pins who signed a run spec: give the spec with --spec FILE")
    if args.spec:
        from node.config import load_config_data
        from node.spec import apply_spec, read_spec

        # The spec and the local config are checked before anything starts.
        spec = read_spec(args.spec, operator=args.operator)
        cfg = apply_spec(spec, load_config_data(args.config, overrides))
    else:
        cfg = load_config(args.config, overrides)
    peers = initial_peers(args.initial_peers)
    from node.site import SiteRank
    from node.site_process import die_with_parent, leave, run_follower, site_command

    site = SiteRank.from_env()
    if site is not None:
        import signal

        # a follower goes at once; the leader stops its network side first
        die_with_parent(signal.SIGTERM if site.leader else signal.SIGKILL)
    if args.nproc_per_node is not None:
        if site is not None:
            raise ValueError("--nproc-per-node under torchrun: torchrun already started the ranks")
        # this process becomes torchrun, which runs this same command once per rank
        command = site_command(args.argv, args.nproc_per_node)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(command[0], command)
    if site is not None and not site.leader:
        # a follower rank: no identity, network or files of its own; it logs to stderr
        leave(run_follower(cfg, site))
    from node.daemon import Node

    node = Node(cfg, initial_peers=peers, byzantine=args.byzantine, spec=spec, site=site)
    return _run_node(node, args, Path(cfg.run.data_dir).expanduser())


def _run_node(node: Node, args: argparse.Namespace, data_dir: Path) -> int:
    """Run ``node`` with its log file; a data directory that cannot be written is one line."""
    handler = None
    try:
        # the log file is the first thing written in the data directory: a directory that
        # cannot be written is reported as such, in one line
        handler = log_file(args, data_dir)
        return node.run()
    except OSError as exc:
        raise ValueError(file_problem(exc, data_dir)) from exc
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def initial_peers(values: Sequence[str]) -> tuple[str, ...]:
    """``--initial-peers``, checked by the rules of ``network.initial_peers``."""
    from pydantic import ValidationError

    from node.config import NetworkConfig

    try:
        return NetworkConfig(initial_peers=tuple(values)).initial_peers
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--initial-peers: {reason}") from None


def cmd_swarm(args: argparse.Namespace) -> int:
    """``atoll swarm``: N real nodes on 127.0.0.1, a live view, and a summary."""
    from node import swarm

    cfg = load_config(args.config, args.overrides)  # validate once, before starting anything
    spec = _swarm_spec(args, cfg.run.max_rounds)
    out = sys.stderr if args.json else sys.stdout
    print(f"starting {args.nodes} nodes in {spec.directory} (Ctrl-C stops them all)", file=out)
    if out.isatty():
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(file=out), refresh_per_second=2) as live:
            summary = swarm.run_swarm(
                spec, cfg, on_tick=lambda ns: live.update(swarm.render_table(ns))
            )
    else:
        summary = swarm.run_swarm(spec, cfg, on_tick=_round_lines(out))
    print(swarm.format_summary(summary), file=out)
    if args.json:
        print(swarm.dump_json(summary))
    ok = not summary["interrupted"] and all(c == 0 for c in summary["exit_codes"])
    return 0 if ok else 1


def _swarm_spec(args: argparse.Namespace, max_rounds: int) -> SwarmSpec:
    """What ``atoll swarm`` launches, its options checked."""
    import time

    from node.swarm import SwarmSpec

    spec = SwarmSpec(
        nodes=args.nodes,
        config_paths=list(args.config or []),
        overrides=list(args.overrides),
        directory=Path(args.dir or f".atoll/swarm-{time.strftime('%Y%m%d-%H%M%S')}"),
        rounds=args.rounds if args.rounds is not None else max_rounds,
        procs_per_node=args.procs_per_node,
    )
    if args.nodes < 1:
        raise ValueError("--nodes must be >= 1")
    if args.procs_per_node < 1:
        raise ValueError("--procs-per-node must be >= 1")
    if args.byzantine:
        mode, _, count = args.byzantine.partition(":")
        parse_mode(mode)  # a clear error for an unknown mode or a bad parameter
        k = int(count or 1)
        if not 0 < k < args.nodes:
            raise ValueError("--byzantine MODE:K needs 0 < K < --nodes")
        for i in range(args.nodes - k, args.nodes):
            spec.extra_args.setdefault(i, []).extend(["--byzantine", mode])
    if args.slowdowns:
        factors = [float(x) for x in args.slowdowns.split(",")]
        if len(factors) != args.nodes or any(x < 1 for x in factors):
            raise ValueError("--slowdowns needs one factor >= 1 per node, e.g. 1,1,2,4")
        for i, x in enumerate(factors):
            spec.extra_args.setdefault(i, []).extend(["--slowdown", str(x)])
    return spec


def _round_lines(out: TextIO) -> Callable[[list[SwarmProcess]], None]:
    """A swarm tick that prints one line per node and round (output that is no terminal)."""
    seen: dict[int, int] = {}

    def tick(nodes: list[SwarmProcess]) -> None:
        for n in nodes:
            st = n.status
            rnd = st.get("round", 0)
            if rnd and seen.get(n.index) != rnd:
                seen[n.index] = rnd
                bpb = st.get("val_bpb")
                print(
                    f"node {n.index} round {rnd} val_bpb "
                    f"{bpb:.3f} sent {st.get('bytes_sent', 0) / 2**20:.2f} MiB"
                    if isinstance(bpb, float)
                    else f"node {n.index} round {rnd}",
                    file=out,
                    flush=True,
                )

    return tick
