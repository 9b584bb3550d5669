"""The ``atoll`` command line: user-facing output lives here and nowhere else."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.config import ConfigError, load_config
from node.fault_modes import ALL_MODES as _BYZANTINE_MODES

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help="TOML config file; repeat to layer files, e.g. a trust policy (defaults when omitted)",
    )
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


def _cmd_run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"run.data_dir={json.dumps(args.data_dir)}")
    if args.rounds is not None:
        overrides.append(f"run.max_rounds={args.rounds}")
    if args.slowdown is not None:
        overrides.append(f"run.slowdown={args.slowdown}")
    spec = None
    if args.spec:
        from node.config import load_config_data
        from node.spec import apply_spec, read_spec

        # The spec and the local config are checked before anything starts.
        spec = read_spec(args.spec)
        cfg = apply_spec(spec, load_config_data(args.config, overrides))
    else:
        cfg = load_config(args.config, overrides)
    initial_peers = _initial_peers(args.initial_peers)
    from node.site import SiteRank, die_with_parent, run_follower, site_command

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
        return run_follower(cfg, site)
    from node.daemon import Node

    node = Node(cfg, initial_peers=initial_peers, byzantine=args.byzantine, spec=spec, site=site)
    data_dir = Path(cfg.run.data_dir).expanduser()
    handler = None
    try:
        # the log file is the first thing written in the data directory: a directory that
        # cannot be written is reported as such, in one line
        handler = _log_file(args, data_dir)
        return node.run()
    except OSError as exc:
        raise ValueError(_file_problem(exc, data_dir)) from exc
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


_LOG_FILE_BYTES = 10 * 2**20
_LOG_FILES_KEPT = 3
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_LEVELS = {10: "debug", 20: "info", 30: "warning", 40: "error", 50: "critical"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: ``t`` (unix time), ``level``,
    ``logger``, ``message`` and, for an exception, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "t": round(record.created, 3),
            # by number: libraries rename levels (hivemind's WARNING prints as WARN)
            "level": _LEVELS.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _formatter(kind: str) -> logging.Formatter:
    return _JsonFormatter() if kind == "json" else logging.Formatter(_LOG_FORMAT)


def _log_file(args: argparse.Namespace, data_dir: Path) -> logging.Handler | None:
    """``DATA_DIR/node.log`` (or ``--log-file``), rotated at 10 MiB, 3 kept; None for
    ``--log-file -`` (``atoll swarm`` captures each node's stderr there itself)."""
    from logging.handlers import RotatingFileHandler

    if args.log_file == "-":
        return None
    path = Path(args.log_file) if args.log_file else data_dir / "node.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(
        path, maxBytes=_LOG_FILE_BYTES, backupCount=_LOG_FILES_KEPT, encoding="utf-8"
    )
    handler.setFormatter(_formatter(args.log_format))
    logging.getLogger().addHandler(handler)
    return handler


def _initial_peers(values: Sequence[str]) -> tuple[str, ...]:
    """``--initial-peers``, checked by the rules of ``network.initial_peers``."""
    from pydantic import ValidationError

    from node.config import NetworkConfig

    try:
        return NetworkConfig(initial_peers=tuple(values)).initial_peers
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--initial-peers: {reason}") from None


def _file_problem(exc: OSError, data_dir: Path | None = None) -> str:
    """One line for a file operation that failed: what failed, and what to do."""
    path = Path(exc.filename) if exc.filename else data_dir
    why = (exc.strerror or str(exc)).lower()
    inside = data_dir is not None and path is not None and path.is_relative_to(data_dir)
    place = f"the data directory {data_dir}" if inside else str(path or "a file")
    choose = "choose another --data-dir" if data_dir is not None else "choose another path"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        writing = f" (writing {path})" if path not in (None, data_dir) else ""
        return f"no space left on the disk of {place}{writing}; free some space or {choose}"
    if exc.errno == errno.EROFS:
        return f"cannot write to {place} ({why}); {choose.replace('another', 'a writable')}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to use {path or place} ({why}); fix its permissions or {choose}"
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and data_dir is not None:
        # a file where the data directory, or a directory above it, should be
        for p in (data_dir, *data_dir.parents):
            if p.exists() and not p.is_dir():
                where = "is a file" if p == data_dir else f"cannot be made: {p} is a file"
                return f"the data directory {data_dir} {where}, not a directory; {choose}"
    if exc.errno == errno.EISDIR:
        return f"{path} is a directory where a file belongs; move it away or {choose}"
    return f"{path or 'a file'}: {why}; check the path and its permissions"


def _cmd_swarm(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from node import swarm

    cfg = load_config(args.config, args.overrides)  # validate once, before starting anything
    directory = Path(args.dir or f".atoll/swarm-{time.strftime('%Y%m%d-%H%M%S')}")
    spec = swarm.SwarmSpec(
        nodes=args.nodes,
        config_paths=list(args.config or []),
        overrides=list(args.overrides),
        directory=directory,
        rounds=args.rounds if args.rounds is not None else cfg.run.max_rounds,
        procs_per_node=args.procs_per_node,
    )
    if args.nodes < 1:
        raise ValueError("--nodes must be >= 1")
    if args.procs_per_node < 1:
        raise ValueError("--procs-per-node must be >= 1")
    if args.byzantine:
        mode, _, count = args.byzantine.partition(":")
        if mode not in _BYZANTINE_MODES:
            raise ValueError(f"--byzantine {mode!r}: expected one of {', '.join(_BYZANTINE_MODES)}")
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
    out = sys.stderr if args.json else sys.stdout
    print(f"starting {args.nodes} nodes in {directory} (Ctrl-C stops them all)", file=out)
    if out.isatty():
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(file=out), refresh_per_second=2) as live:
            summary = swarm.run_swarm(
                spec, cfg, on_tick=lambda ns: live.update(swarm.render_table(ns))
            )
    else:
        seen: dict[int, int] = {}

        def tick(nodes: list[swarm.SwarmProcess]) -> None:
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

        summary = swarm.run_swarm(spec, cfg, on_tick=tick)
    print(swarm.format_summary(summary), file=out)
    if args.json:
        print(swarm.dump_json(summary))
    ok = not summary["interrupted"] and all(c == 0 for c in summary["exit_codes"])
    return 0 if ok else 1


def _open_audit(data_dir: str):
    from pathlib import Path

    from verification.audit import AuditLog

    db = Path(data_dir).expanduser() / "atoll.db"
    if not db.exists():
        raise ValueError(f"no audit log at {db} (is --data-dir a node's data directory?)")
    return AuditLog(db)


def _resolve_peer(log: Any, peer: str | None) -> str | None:
    """A full PeerID from what the operator typed: the PeerID itself, or the shortened
    form ``atoll audit show`` prints (``...`` and its last characters)."""
    if peer is None:
        return None
    suffix = peer.lstrip(".…")
    if suffix == peer and len(peer) >= 46:
        return peer  # a whole PeerID
    senders = sorted({row.sender for row in log.rows() if row.sender.endswith(suffix)})
    if len(senders) == 1:
        return senders[0]
    if not senders:
        raise ValueError(f"no sender in the audit log ends with {suffix!r}")
    raise ValueError(f"{suffix!r} matches {len(senders)} senders: {', '.join(senders)}")


def _cmd_audit(args: argparse.Namespace) -> int:
    log = _open_audit(args.data_dir)
    try:
        if args.audit_command == "verify":
            ok, bad, reason = log.verify()
            count, head = log.head()
            if ok:
                print(f"audit log OK: {count} rows, head {head[:16]}")
                return 0
            where = f"row {bad}" if bad is not None else "the chain head"
            print(f"audit log BROKEN at {where}: {reason}")
            return 1
        if args.audit_command == "show":
            peer = _resolve_peer(log, args.peer)
            rows = log.rows(round=args.round, peer=peer, limit=args.limit)
            if args.json:
                for row in rows:
                    print(json.dumps(row.__dict__))
                return 0
            print(
                f"{'id':>6} {'round':>5} {'frag':>4} {'part':>4}  {'sender':<16} {'tokens':>8}  verdict"
            )
            for row in rows:
                reason = f" ({row.reason})" if row.reason else ""
                print(
                    f"{row.id:>6} {row.round:>5} {row.fragment:>4} {row.part:>4}  "
                    f"...{row.sender[-13:]:<13} {row.tokens:>8}  {row.verdict}{reason}"
                )
            return 0
        blame = log.blame(args.round)
        if args.json:
            print(json.dumps(blame))
            return 0
        if not blame:
            print(
                f"round {args.round}: no rows in this node's audit log (it owned no part that "
                "round, or the round has not happened here)"
            )
            return 0
        print(f"round {args.round}: contributions in the model")
        for peer, counts in sorted(blame.items()):
            print(
                f"  {peer}  accepted {counts['accepted']:>3}  rejected {counts['rejected']:>3}  "
                f"tokens {counts['tokens']}"
            )
        return 0
    finally:
        log.close()


_STALE_SECONDS = 15.0
"""A running node rewrites its status every ``network.registry_seconds`` (2 s): an older
one belongs to a node that stopped or is stuck."""
_RUNNING_STATES = frozenset({"starting", "joining", "ready", "training", "lingering"})


def _status_age(status: dict[str, Any]) -> float | None:
    """Seconds since the node wrote ``status`` (None when it does not say)."""
    import time

    updated = status.get("updated")
    if not isinstance(updated, (int, float)):
        return None
    return max(0.0, time.time() - float(updated))


def _cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    path = Path(args.data_dir).expanduser() / "status.json"
    if not path.exists():
        raise ValueError(f"no status at {path} (is --data-dir a node's data directory?)")
    status = json.loads(path.read_text())
    swarm = status.get("swarm")
    if args.json:
        print(json.dumps(status))
        return 0
    state = status.get("state", "?")
    print(
        f"node {status.get('peer_id', '?')}  state {state}  "
        f"round {status.get('round', '-')}  pid {status.get('pid', '-')}"
    )
    age = _status_age(status)
    if age is not None and age > _STALE_SECONDS and state in _RUNNING_STATES:
        print(
            f"STALE: this status is {age:.0f} s old (a running node rewrites it every few "
            f"seconds): the node has stopped or is stuck; its last state was {state}"
        )
    elif age is not None:
        print(f"status written {age:.1f} s ago")
    _print_progress(status)
    _print_network(status)
    _print_join_line(status)
    if swarm is None:
        print("no control channel (control.enabled = false, or the node has not started it yet)")
        return 0
    from rich.console import Console
    from rich.table import Table

    from verification.reputation import INITIAL_SCORE

    reputations = status.get("reputations", {})
    table = Table(title=f"peers seen in heartbeats ({len(swarm['peers'])})")
    columns = ("peer", "version", "round", "step", "tokens/s", "reachable", "last seen")
    for column in (*columns, "reputation"):
        table.add_column(column)
    for peer, info in sorted(swarm["peers"].items()):
        # a peer this node has not judged yet holds the store's starting score
        rep = reputations.get(peer, {"score": INITIAL_SCORE, "status": "ok"})
        # as of now, not as of when the status was written
        seen = float(info.get("last_seen_s") or 0.0) + (age or 0.0)
        table.add_row(
            f"...{peer[-12:]}",
            str(info.get("version")),
            str(info.get("round")),
            str(info.get("step")),
            f"{info.get('throughput') or 0:.0f}",
            {True: "yes", False: "no (client)"}.get(info.get("reachable"), "?"),
            f"{seen:.1f} s ago",
            f"{rep['score']:.2f} {rep['status']}",
        )
    Console().print(table)
    dropped = swarm.get("dropped") or {}
    print(
        f"sidecar pid {swarm.get('sidecar_pid')}, restarts {swarm.get('sidecar_restarts', 0)}; "
        f"verdicts {swarm.get('verdicts', 0)} (ignored: {swarm.get('forged_verdicts', 0)}); "
        f"dropped {sum(dropped.values())} {dict(dropped) if dropped else ''}"
    )
    return 0


def _print_progress(status: dict[str, Any]) -> None:
    """This node's own training: step, loss, bits/byte, traffic, flagged peers."""

    def number(key: str, fmt: str) -> str:
        value = status.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    sent = status.get("bytes_sent")
    mib = f"{sent / 2**20:.1f} MiB" if isinstance(sent, (int, float)) else "-"
    params = status.get("params")
    model = f"{params / 1e6:.2f} M" if isinstance(params, (int, float)) else "-"
    print(
        f"model {model} parameters  step {number('step', 'd')}  loss {number('loss', '.3f')}  "
        f"val bits/byte {number('val_bpb', '.3f')}  tokens {number('tokens', 'd')}  sent {mib}"
    )
    flagged = status.get("flagged") or {}
    listed = ", ".join(f"{peer} ({why})" for peer, why in sorted(flagged.items()))
    print(f"flagged peers: {listed or 'none'}")


def _print_join_line(status: dict[str, Any]) -> None:
    """Where this node listens, and the line another node joins it with."""
    maddrs = [str(m) for m in status.get("maddrs") or []]
    peer = status.get("peer_id")
    if not maddrs or not peer:
        return
    full = [m if "/p2p/" in m else f"{m}/p2p/{peer}" for m in maddrs]
    print(f"listens on {' '.join(full)}")
    print(f"another node joins with: atoll run --initial-peers {full[0]}")


def _print_network(status: dict[str, Any]) -> None:
    """Reachability, the run spec, refused peers and warnings from a node's status."""
    reach = status.get("reachability")
    if isinstance(reach, dict) and reach.get("summary"):
        print(f"reachability: {reach['summary']}")
    spec = status.get("spec")
    if spec:
        source = "run spec" if status.get("spec_file") else "shared settings"
        print(f"{source} {str(spec)[:12]}; live peers {status.get('live_peers', '-')}")
    for peer, reason in sorted((status.get("refused_peers") or {}).items()):
        print(f"refused peer {peer}: {reason}")
    if status.get("metrics_url"):
        print(
            f"metrics {status['metrics_url']}/metrics, state {status['metrics_url']}/api/v1/state"
        )
    warning = status.get("control_warning")
    if warning:
        print(f"WARNING: {warning}")
    if status.get("alone_syncs"):
        print(
            f"WARNING: {status['alone_syncs']} sync(s) averaged alone while peers were live; "
            f"last: {status.get('alone_warning')}"
        )


def _node_data(data_dir: str) -> Path:
    path = Path(data_dir).expanduser()
    if not (path / "atoll.db").exists() and not (path / "status.json").exists():
        raise ValueError(f"no node data in {path} (is --data-dir a node's data directory?)")
    return path


def _running_pid(path: Path) -> int | None:
    """The pid of the node running in ``path``, or None when none is."""
    import os

    try:
        status = json.loads((path / "status.json").read_text())
    except (OSError, ValueError):
        return None
    pid = status.get("pid")
    if status.get("state") not in _RUNNING_STATES or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # it died without writing its final status
    except PermissionError:
        pass  # alive, another user's
    return pid


def _cmd_peers(args: argparse.Namespace) -> int:
    from verification.reputation import ReputationStore

    path = _node_data(args.data_dir)
    with ReputationStore(path / "atoll.db") as store:
        rows = [
            {
                "peer": s.peer,
                "score": round(s.score, 3),
                "status": s.status,
                "violations": s.violations,
                "until_round": s.until_round,
                "reason": s.reason,
            }
            for s in store.all()
        ]
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no peers judged yet")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"peers this node has judged ({len(rows)})")
    for column in ("peer", "score", "standing", "violations", "reason"):
        table.add_column(column)
    for row in rows:
        standing = row["status"]
        if standing == "quarantined":
            standing += f" until round {row['until_round']}"
        table.add_row(
            row["peer"], f"{row['score']:.2f}", standing, str(row["violations"]), row["reason"]
        )
    Console().print(table)
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from node.admin import Command, submit

    path = _node_data(args.data_dir)
    command = Command(args.command, args.peer, args.reason)
    pid = _running_pid(path)
    if pid is not None:
        try:
            answer = submit(path, command, timeout=args.timeout)
        except TimeoutError as exc:
            raise ValueError(f"node pid {pid}: {exc}") from None
        if not answer.get("ok"):
            raise ValueError(f"the node refused the command: {answer.get('error')}")
        standing, where = answer["standing"], f"by the running node (pid {pid})"
    else:
        from verification.policy import TrustPolicy
        from verification.verifier import Verifier

        verifier = Verifier(TrustPolicy(), path / "atoll.db", me="")
        try:
            standing = verifier.operator(command.op, command.peer, command.reason)
        finally:
            verifier.close()
        where = "in the node's files (it is not running)"
    print(
        f"{command.peer}: {standing['status']}, score {standing['score']:.2f}, "
        f"{standing['violations']} violations; {args.command} applied {where} and recorded "
        "in its audit log"
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).expanduser()
    if args.format == "hf":
        from node.handoff import export_hf

        done = export_hf(data_dir, Path(args.out), args.round, force=args.force)
        print(
            f"wrote {done['path']}: a {done['model_type']} model of {done['tensors']} tensors "
            f"and its tokenizer, the global parameters of round {done['round']} (run "
            f"{done['run_id'] or '?'}, from {done['checkpoint']}); load it with "
            f"AutoModelForCausalLM.from_pretrained({done['path']!r})"
        )
        if done["auto_tokenizer"]:
            print(
                f"note: AutoTokenizer.from_pretrained picks {done['auto_tokenizer']} for a "
                f"{done['model_type']} model, which splits text its own way; load the tokenizer "
                f"the model was trained with by PreTrainedTokenizerFast.from_pretrained"
                f"({done['path']!r})"
            )
        return 0
    from node.export import export_model

    done = export_model(data_dir, Path(args.out), args.round)
    print(
        f"wrote {done['path']}: {done['tensors']} tensors, the global parameters of round "
        f"{done['round']} (run {done['run_id'] or '?'}, from {done['checkpoint']}; global "
        f"state digest {done['global_digest'][:16] or 'not recorded'})"
    )
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from node.handoff import sample

    text, source = sample(
        Path(args.data_dir).expanduser(),
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        round_=args.round,
    )
    print(
        f"# round {source['round']} of run {source['run_id'] or '?'} ({source['checkpoint']})",
        file=sys.stderr,
    )
    print(f"{args.prompt}{text}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from node.plan import PlanInput, describe, parse_count, plan

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
    if args.params is not None:
        params = parse_count(args.params)
    else:
        import torch

        from node.bindings import bind
        from node.model import build_model

        model_cfg = bind(cfg).model  # a preset's vocabulary: the tokenizer's
        with torch.device("meta"):  # counted, not allocated: a 1B model costs nothing
            model = build_model(model_cfg)
        params = sum(p.numel() for p in model.parameters())
    sync = cfg.sync
    inp = PlanInput(
        params=params,
        bandwidth_gbit=args.bandwidth_gbit,
        step_seconds=args.step_seconds,
        codec=sync.codec,
        block_size=sync.block_size,
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


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    import signal

    from node.prepare import Interrupted, prepare

    if args.vocab_size is not None and not args.train_tokenizer:
        raise ValueError("--vocab-size is the size of a tokenizer to train: add --train-tokenizer")
    if args.train_tokenizer and args.vocab_size is None:
        raise ValueError("--train-tokenizer needs --vocab-size N (e.g. 8192)")
    if args.workers < 1:
        raise ValueError("--workers must be >= 1")
    if not args.piece_mb > 0:
        raise ValueError("--piece-mb must be > 0")
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


def _cmd_keygen(args: argparse.Namespace) -> int:
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
        raise ValueError(_file_problem(exc, path.parent)) from exc
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


def _cmd_spec_create(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.bindings import bind
    from node.spec import create_spec, write_spec
    from protocol.p2p.addrs import with_peer_id
    from verification.errors import VerificationError
    from verification.identity import Identity

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
    spec = create_spec(cfg, identity, bootstrap=bootstrap, t0=args.t0)
    write_spec(spec, args.out, force=args.force)
    print(f"wrote {args.out}: run {spec.run_id}, spec {spec.short}, creator {spec.creator}")
    if spec.t0 is not None:
        print(f"round 1 starts at {_utc(spec.t0)} (t0 {spec.t0})")
    if not spec.bootstrap:
        print("no --bootstrap given: volunteers must pass --initial-peers to find the run")
    print(f"volunteers join with: atoll run --spec {args.out}")
    return 0


def _utc(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cmd_spec_show(args: argparse.Namespace) -> int:
    import base64

    from node.spec import read_spec

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
    print("shared settings")
    for section, values in spec.shared.items():
        for key, value in values.items():
            print(f"  {section}.{key} = {json.dumps(value)}")
    return 0


def _version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare source tree)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("atoll")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atoll",
        description=(
            "Atoll: train one model across scattered machines. Run a node (atoll run), "
            "try a swarm on this machine (atoll swarm), and watch and manage a node "
            "(status, peers, ban, pardon, audit, export); prepare a large corpus (data) "
            "and plan a run's links (plan)."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text, or one JSON object each (for log shippers)",
    )
    parser.add_argument("--version", action="version", version=f"atoll {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate", help="train K DiLoCo replicas in one process (the algorithmic reference)"
    )
    _add_config_args(sim)
    sim.add_argument("--replicas", type=int, default=4, help="K, the number of replicas")
    sim.add_argument("--inner-steps", type=int, default=None, help="H (sync.inner_steps)")
    sim.add_argument("--rounds", type=int, default=6, help="outer rounds to train")
    sim.add_argument("--fragments", type=int, default=None, help="sync.fragments")
    sim.add_argument("--codec", default=None, help="none, fp16, bf16, int8 or int4")
    sim.add_argument("--json", action="store_true", help="last line: one JSON summary")
    sim.set_defaults(func=_cmd_simulate)

    run = sub.add_parser("run", help="run one training node")
    _add_config_args(run)
    run.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs to join through"
    )
    run.add_argument("--data-dir", default=None, help="run.data_dir (key, checkpoints, logs)")
    run.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    run.add_argument(
        "--slowdown",
        type=float,
        default=None,
        metavar="X",
        help="run X times slower than this hardware (stands in for a slower machine)",
    )
    run.add_argument(
        "--byzantine",
        default=None,
        metavar="MODE",
        help="fault injection for tests and benchmarks: " + ", ".join(_BYZANTINE_MODES),
    )
    run.add_argument(
        "--spec",
        default=None,
        metavar="FILE",
        help="join the run this signed spec describes (atoll spec create makes one)",
    )
    run.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="run this node as a site of N processes (torchrun; gloo on CPU, NCCL on GPUs): "
        "rank 0 joins the swarm, all N train data-parallel",
    )
    run.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="where the node logs besides stderr, rotated at 10 MiB (default DATA_DIR/node.log; - for none)",
    )
    run.set_defaults(func=_cmd_run)

    sw = sub.add_parser("swarm", help="run N real nodes on 127.0.0.1 with a live view")
    _add_config_args(sw)
    sw.add_argument("--nodes", type=int, default=4, help="how many nodes to start")
    sw.add_argument("--rounds", type=int, default=None, help="rounds per node (run.max_rounds)")
    sw.add_argument("--dir", default=None, help="swarm directory (default .atoll/swarm-TIME)")
    sw.add_argument("--json", action="store_true", help="last line: one JSON summary")
    sw.add_argument(
        "--procs-per-node",
        type=int,
        default=1,
        metavar="P",
        help="run each node as a site of P processes (torchrun, gloo inside the site)",
    )
    sw.add_argument(
        "--slowdowns",
        default=None,
        metavar="X,X,...",
        help="per-node slowdown factors, e.g. 1,1,2,4",
    )
    sw.add_argument(
        "--byzantine",
        default=None,
        metavar="MODE[:K]",
        help="make the last K nodes (default 1) faulty in MODE, for tests and benchmarks",
    )
    sw.set_defaults(func=_cmd_swarm)

    audit = sub.add_parser("audit", help="inspect a node's hash-chained audit log")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    for name, text in (
        ("verify", "check the hash chain; exit 1 and name the first bad row if broken"),
        ("show", "list audit rows"),
        ("blame", "whose contributions are in the model at a round"),
    ):
        a = audit_sub.add_parser(name, help=text)
        a.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
        a.add_argument("--json", action="store_true", help="JSON instead of a table")
        if name == "show":
            a.add_argument("--round", type=int, default=None, help="only rows of this round")
            a.add_argument(
                "--peer", default=None, help="only rows of this sender (whole or ...shortened)"
            )
            a.add_argument("--limit", type=int, default=None, help="at most this many rows")
        if name == "blame":
            a.add_argument("--round", type=int, required=True, help="the training round")
        a.set_defaults(func=_cmd_audit)

    status = sub.add_parser("status", help="the swarm as a node sees it from heartbeats")
    status.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
    status.add_argument("--json", action="store_true", help="the node's whole status as JSON")
    status.set_defaults(func=_cmd_status)

    peers = sub.add_parser("peers", help="every peer this node has judged: score, standing")
    peers.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
    peers.add_argument("--json", action="store_true", help="one JSON list")
    peers.set_defaults(func=_cmd_peers)
    for name, text, reason in (
        ("ban", "exclude a peer for good (until pardoned)", None),
        ("pardon", "lift a peer's ban or quarantine", "pardoned by the operator"),
    ):
        op = sub.add_parser(name, help=text)
        op.add_argument("peer", help="the peer's PeerID")
        op.add_argument(
            "--reason",
            required=reason is None,
            default=reason,
            help="why (recorded in the audit log)",
        )
        op.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
        op.add_argument(
            "--timeout", type=float, default=20.0, help="seconds to wait for a running node"
        )
        op.set_defaults(func=_cmd_operator)

    export = sub.add_parser(
        "export",
        help="write the agreed global parameters of a checkpoint: a from_pretrained folder "
        "(--format hf) or one safetensors file",
    )
    export.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
    export.add_argument(
        "--out", required=True, help="the folder (--format hf) or .safetensors file to write"
    )
    export.add_argument(
        "--format",
        choices=("atoll", "hf"),
        default="atoll",
        help="hf: a folder transformers loads (config, model.safetensors, tokenizer); "
        "atoll: the parameters under the model's own names (default)",
    )
    export.add_argument(
        "--round", type=int, default=None, help="the checkpoint of this round (default newest)"
    )
    export.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    export.set_defaults(func=_cmd_export)

    smp = sub.add_parser(
        "sample", help="print a continuation of a prompt from the agreed global parameters"
    )
    smp.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
    smp.add_argument("--prompt", default="", help="the text to continue")
    smp.add_argument("--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    smp.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0: the likeliest token",
    )
    smp.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens")
    smp.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    smp.add_argument(
        "--round", type=int, default=None, help="the checkpoint of this round (default newest)"
    )
    smp.set_defaults(func=_cmd_sample)

    pl = sub.add_parser(
        "plan", help="bytes, link time and utilization of a run's syncs, before starting it"
    )
    _add_config_args(pl)
    pl.add_argument(
        "--params", default=None, help="model size, e.g. 1T, 7B, 480k (default: the config's)"
    )
    pl.add_argument(
        "--codec", default=None, help="none, fp16, bf16, int8 or int4 (default: the config's)"
    )
    pl.add_argument("--fragments", type=int, default=None, help="fragments (default: the config's)")
    pl.add_argument(
        "--group-size", type=int, default=None, help="butterfly group size (default: the config's)"
    )
    pl.add_argument(
        "--trigger",
        choices=("steps", "seconds"),
        default=None,
        help="sync.trigger (default: the config's)",
    )
    pl.add_argument(
        "--inner-steps",
        type=int,
        default=None,
        help="H, inner steps per round (default: the config's)",
    )
    pl.add_argument(
        "--round-seconds", type=float, default=None, help="round length with --trigger seconds"
    )
    pl.add_argument(
        "--tau",
        type=int,
        default=None,
        help="steps before a result is applied (default: the config's)",
    )
    pl.add_argument(
        "--step-seconds", type=float, required=True, help="seconds one inner step takes"
    )
    pl.add_argument("--bandwidth-gbit", type=float, required=True, help="each node's link, Gbit/s")
    pl.add_argument("--distance-km", type=float, default=0.0, help="distance between sites, km")
    pl.add_argument(
        "--round-trips", type=int, default=2, help="round trips a sync waits for (default 2)"
    )
    pl.add_argument(
        "--overhead-seconds",
        type=float,
        default=0.0,
        help="fixed seconds per sync besides the link (matchmaking; 0.58 measured on loopback)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_cmd_plan)

    data = sub.add_parser("data", help="prepare a corpus as token shards read through memory maps")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser(
        "prepare",
        help="tokenize text, .jsonl or .parquet files into shards (train.bin, val.bin, "
        "meta.json) for data.shards",
        description="Without a tokenizer, text files are copied as bytes (the byte model's "
        "tokens); with --tokenizer or --train-tokenizer, or from .jsonl/.parquet, each "
        "document is tokenized and ends with the tokenizer's EOS token. An interrupted "
        "prepare resumes when the same command runs again.",
    )
    prepare.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="files or globs (quote ** globs): text (a document each), .jsonl, .parquet",
    )
    prepare.add_argument("--out", required=True, help="directory to write the shards to")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share held out for validation (files by a hash of their path as bytes, "
        "documents by a hash of their text)",
    )
    prepare.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer.json or a tokenizer folder (loaded offline)",
    )
    prepare.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a byte-level BPE on the corpus (saved in OUT/tokenizer)",
    )
    prepare.add_argument(
        "--vocab-size", type=int, default=None, metavar="N", help="tokens of the BPE to train"
    )
    prepare.add_argument("--field", default="text", help="the text field of .jsonl lines")
    prepare.add_argument("--column", default="text", help="the text column of .parquet files")
    prepare.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="the end-of-document token (default: the tokenizer's)",
    )
    prepare.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, os.cpu_count() or 1)),
        help="tokenizing processes (default: the cores, at most 8)",
    )
    prepare.add_argument(
        "--piece-mb",
        type=float,
        default=16.0,
        help="MiB of text per unit of work: what an interruption can lose (default 16)",
    )
    prepare.add_argument("--force", action="store_true", help="replace shards already in --out")
    prepare.set_defaults(func=_cmd_data_prepare)

    keygen = sub.add_parser("keygen", help="create this node's Ed25519 identity key")
    keygen.add_argument("--data-dir", default=".atoll/node", help="the node's data directory")
    keygen.add_argument("--out", default=None, help="key file (default DATA_DIR/identity.key)")
    keygen.add_argument("--force", action="store_true", help="replace an existing key")
    keygen.set_defaults(func=_cmd_keygen)

    spec = sub.add_parser("spec", help="create or inspect a signed run spec")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    create = spec_sub.add_parser(
        "create", help="sign a config's shared settings into a run spec for volunteers to join"
    )
    _add_config_args(create)
    create.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="MADDR",
        help="multiaddr ending in /p2p/<peer id> that joining nodes dial (repeatable)",
    )
    create.add_argument(
        "--key", default=None, help="signing key (default DATA_DIR/identity.key, made if missing)"
    )
    create.add_argument("--data-dir", default=".atoll/node", help="where the default key lives")
    create.add_argument(
        "--t0",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="round 1's start for sync.trigger = seconds (default: a round boundary >= 60 s ahead)",
    )
    create.add_argument("--out", required=True, help="spec file to write, e.g. run.toml")
    create.add_argument("--force", action="store_true", help="replace an existing file")
    create.set_defaults(func=_cmd_spec_create)
    show = spec_sub.add_parser("show", help="verify a run spec and print it")
    show.add_argument("file", help="the spec file")
    show.add_argument("--json", action="store_true", help="the spec as one JSON object")
    show.set_defaults(func=_cmd_spec_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``atoll`` console script."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(_formatter(args.log_format))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[stderr])
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into head or less, closed early
        return 0
    except KeyboardInterrupt:
        print("atoll: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # The traceback is for -v (debug logging); the operator gets one line.
        logger.debug("atoll %s failed", args.command, exc_info=True)
        line = _known_error(exc)
        if line is None:
            print(f"atoll: internal error: {exc!r}; run with -v for the traceback", file=sys.stderr)
            return 1
        print(f"atoll: {line}", file=sys.stderr)
        return 2


def _known_error(exc: Exception) -> str | None:
    """The one line for an error a user can act on, or None for an unexpected one."""
    from node.swarm import NodeFailed
    from verification.errors import VerificationError

    if isinstance(exc, (ValueError, NodeFailed)):  # ConfigError, DataError, SpecError, ...
        return str(exc)
    if "node.site" in sys.modules:  # loaded by commands that may run as a site
        from node.site import SiteFailed

        if isinstance(exc, SiteFailed):
            return f"{exc}; the node stopped (torchrun stops the other ranks)"
    if isinstance(exc, VerificationError):
        return f"{exc}; check the file or peer it names"
    if isinstance(exc, OSError):
        return _file_problem(exc)
    if isinstance(exc, RuntimeError) and "protocol.p2p.transport" in sys.modules:
        return _network_problem(exc)  # only commands that start a network side load it
    return None


def _network_problem(exc: RuntimeError) -> str | None:
    """The network side's start-up errors (:meth:`protocol.p2p.transport.Transport.start`)."""
    import concurrent.futures

    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from protocol.control.channel import ControlChannelError
    from protocol.p2p.transport import BootstrapUnreachable, NotDialable

    if isinstance(exc, (BootstrapUnreachable, NotDialable)):
        return str(exc)
    if isinstance(exc, ControlChannelError):
        return f"{exc}; check control.port and network.host, and run with -v for its output"
    if isinstance(exc.__cause__, (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError)):
        return (
            f"the network side did not start ({exc.__cause__}); check network.host and "
            "network.port, and run with -v for p2pd's output"
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
