"""``atoll simulate``, ``atoll run``, ``atoll join`` and ``atoll swarm``: training, in one
process, as one node (from a config, a spec file or a run address), or as a swarm of
real nodes on this machine."""

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
from node.swarm.fault_modes import parse_mode

if TYPE_CHECKING:
    from node.config import AtollConfig
    from node.ops.swarm import SwarmProcess, SwarmSpec
    from node.spec import RunSpec
    from node.train.site import SiteRank

__all__ = ["cmd_join", "cmd_run", "cmd_simulate", "cmd_swarm", "initial_peers"]


def cmd_simulate(args: argparse.Namespace) -> int:
    """``atoll simulate``: K DiLoCo replicas in one process, round by round."""
    from node.ops.simulate import simulate

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
    if args.join:
        if args.spec:
            raise ValueError("--join fetches the run's spec: give --join or --spec, not both")
        return _join(args, args.join, initial_peers(args.initial_peers))
    overrides = _node_overrides(args)
    spec = None
    if args.operator and not args.spec:
        raise ValueError("--operator pins who signed a run spec: give the spec with --spec FILE")
    if args.spec:
        from node.config import load_config_data
        from node.spec import apply_spec
        from node.spec_file import read_spec

        # The spec and the local config are checked before anything starts.
        spec = read_spec(args.spec, operator=args.operator)
        cfg = apply_spec(spec, load_config_data(args.config, overrides))
    else:
        cfg = load_config(args.config, overrides)
    return _start_node(args, cfg, spec, initial_peers(args.initial_peers))


def cmd_join(args: argparse.Namespace) -> int:
    """``atoll join ADDRESS``: ``atoll run --join ADDRESS``."""
    return _join(args, args.address, ())


def _join(args: argparse.Namespace, text: str, peers: tuple[str, ...]) -> int:
    """Fetch the run's spec from the swarm, pinned to its operator, keep a copy in the
    data directory and run from it."""
    from node.config import load_config_data
    from node.spec import apply_spec
    from node.swarm.join import RunAddress, fetch_spec, save_spec
    from node.train.site import SiteRank

    address = RunAddress.parse(text)
    if SiteRank.from_env() is not None:
        raise ValueError(
            "joining by address under torchrun: give the node --nproc-per-node instead, or "
            "fetch the spec once (atoll spec fetch ADDRESS --out FILE) and start the ranks "
            "with atoll run --spec FILE --operator PEERID"
        )
    operator = args.operator or address.peer_id
    data = load_config_data(args.config, _node_overrides(args))
    # the node's own network settings: where to listen, how long to wait for the peer
    net = _fetch_settings(data.get("network", {}))
    print(f"fetching run {address.run_id!r}'s spec from {address.peer_id}", flush=True)
    spec, raw = fetch_spec(
        address, operator, host=net.host, timeout=net.request_timeout, wait=net.join_timeout
    )
    cfg = apply_spec(spec, data)  # the local config is checked before anything is written
    path = Path(cfg.run.data_dir).expanduser() / "run-spec.toml"
    save_spec(raw, path)
    print(
        f"run {spec.run_id!r}: spec {spec.short} signed by the operator {spec.creator}; "
        f"a copy is in {path}",
        flush=True,
    )
    if args.nproc_per_node is not None:
        # torchrun starts every rank with the spec file instead of the address
        args.argv = _with_spec_file(args.argv, text, str(path), operator)
    return _start_node(args, cfg, spec, peers)


_FETCH_KEYS = ("host", "request_timeout", "join_timeout")
"""The network keys of a node's own config that its spec fetch follows."""


def _fetch_settings(network: dict[str, Any]) -> Any:
    """The :data:`_FETCH_KEYS` of a node's raw ``[network]`` table, checked.

    Raises:
        ConfigError: one of them is invalid.
    """
    fields = {k: v for k, v in network.items() if k in _FETCH_KEYS}
    return _network_config(fields, lambda key: f"network.{key}")


def _network_config(fields: dict[str, Any], name: Callable[[str], str]) -> Any:
    """A :class:`node.config.NetworkConfig` of ``fields`` (defaults for the rest).

    Raises:
        ConfigError: a field is invalid, named by ``name(its key)``.
    """
    from pydantic import ValidationError

    from node.config import NetworkConfig

    try:
        return NetworkConfig(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(p) for p in error["loc"])
        raise ConfigError(f"{name(key)}: {error['msg'].removeprefix('Value error, ')}") from None


def _node_overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` values and the options of ``run`` and ``join`` that stand for keys."""
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"run.data_dir={json.dumps(args.data_dir)}")
    if args.rounds is not None:
        overrides.append(f"run.max_rounds={args.rounds}")
    if args.slowdown is not None:
        overrides.append(f"run.slowdown={args.slowdown}")
    return overrides


def _with_spec_file(argv: list[str], address: str, path: str, operator: str) -> list[str]:
    """A join's command line (``join ADDRESS`` or ``run --join ADDRESS``) as ``run
    --spec PATH --operator OPERATOR``, its other arguments kept."""
    spec = ["--spec", path, "--operator", operator]
    out: list[str] = []
    command, dropped, i = None, False, 0
    while i < len(argv):
        a = argv[i]
        if command is None and a in ("join", "run"):
            command = a
            out.extend(["run", *spec] if a == "join" else ["run"])
        elif command == "join" and a == address and not dropped:
            dropped = True  # join's positional address
        elif command == "run" and a == "--join":
            out.extend(spec)
            i += 1  # and its value
        elif command == "run" and a.startswith("--join="):
            out.extend(spec)
        else:
            out.append(a)
        i += 1
    return out


def _start_node(
    args: argparse.Namespace, cfg: AtollConfig, spec: RunSpec | None, peers: tuple[str, ...]
) -> int:
    """Run the node of ``cfg``: as it is, as torchrun of ``--nproc-per-node`` ranks, or
    as a follower rank of a site."""
    from node.train.site import SiteRank
    from node.train.site_process import die_with_parent, leave, run_follower, site_command

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
    return _run_node(args, cfg, spec, peers, site)


def _run_node(
    args: argparse.Namespace,
    cfg: AtollConfig,
    spec: RunSpec | None,
    peers: tuple[str, ...],
    site: SiteRank | None,
) -> int:
    """Run the node with its log file. The data directory and the identity key are
    checked before torch loads, so a directory that cannot be written or a broken key
    is one line within a second; a file the run cannot write later is one line too."""
    from node.ops.keyfile import load_identity

    data_dir = Path(cfg.run.data_dir).expanduser()
    handler = None
    try:
        # the log file is the first thing written in the data directory
        handler = log_file(args, data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        load_identity(data_dir / "identity.key")
        from node.daemon import Node

        node = Node(cfg, initial_peers=peers, byzantine=args.byzantine, spec=spec, site=site)
        return node.run()
    except OSError as exc:
        raise ValueError(file_problem(exc, data_dir)) from exc
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def initial_peers(values: Sequence[str]) -> tuple[str, ...]:
    """``--initial-peers``, checked by the rules of ``network.initial_peers``."""
    return _network_config(
        {"initial_peers": tuple(values)}, lambda key: "--initial-peers"
    ).initial_peers


def cmd_swarm(args: argparse.Namespace) -> int:
    """``atoll swarm``: N real nodes on 127.0.0.1, a live view, and a summary."""
    from node.ops import swarm

    cfg = load_config(args.config, args.overrides)  # validate once, before starting anything
    spec = _swarm_spec(args, cfg.run.max_rounds)
    swarm.interrupt_on_sigterm()
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

    from node.ops.swarm import SwarmSpec

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
