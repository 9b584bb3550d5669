"""Watching and managing a node from its data directory: ``atoll status``, ``peers``,
``ban`` and ``pardon`` (``atoll audit`` is :mod:`node.cli.auditing`).

Every command here reads the node's files (``status.json``, ``atoll.db``); ``ban`` and
``pardon`` go through a running node's admin folder, or change its files when it is
not running (:mod:`node.run.admin`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["cmd_operator", "cmd_peers", "cmd_status"]

_STALE_SECONDS = 15.0
"""A running node rewrites its status every ``network.registry_seconds`` (2 s): an older
one belongs to a node that stopped or is stuck."""
_RUNNING_STATES = frozenset({"starting", "joining", "ready", "training", "lingering"})


# ---- status ---------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """``atoll status``: the node's state, progress and network, and the peers it hears."""
    path = Path(args.data_dir).expanduser() / "status.json"
    if not path.exists():
        raise ValueError(f"no status at {path} (is --data-dir a node's data directory?)")
    status = json.loads(path.read_text())
    swarm = status.get("swarm")
    if args.json:
        print(json.dumps(status))
        return 0
    age = _status_age(status)
    _print_state(status, age)
    _print_progress(status)
    _print_network(status)
    _print_joining(status)
    _print_join_line(status)
    if swarm is None:
        print("no control channel (control.enabled = false, or the node has not started it yet)")
        return 0
    _print_peers(status, swarm, age)
    dropped = swarm.get("dropped") or {}
    print(
        f"sidecar pid {swarm.get('sidecar_pid')}, restarts {swarm.get('sidecar_restarts', 0)}; "
        f"verdicts {swarm.get('verdicts', 0)} (ignored: {swarm.get('forged_verdicts', 0)}); "
        f"dropped {sum(dropped.values())} {dict(dropped) if dropped else ''}"
    )
    return 0


def _status_age(status: dict[str, Any]) -> float | None:
    """Seconds since the node wrote ``status`` (None when it does not say)."""
    updated = status.get("updated")
    if not isinstance(updated, (int, float)):
        return None
    return max(0.0, time.time() - float(updated))


def _print_state(status: dict[str, Any], age: float | None) -> None:
    """Who the node is, what it does, and whether its status is fresh."""
    state = status.get("state", "?")
    print(
        f"node {status.get('peer_id', '?')}  state {state}  "
        f"round {status.get('round', '-')}  pid {status.get('pid', '-')}"
    )
    if age is not None and age > _STALE_SECONDS and state in _RUNNING_STATES:
        print(
            f"STALE: this status is {age:.0f} s old (a running node rewrites it every few "
            f"seconds): the node has stopped or is stuck; its last state was {state}"
        )
    elif age is not None:
        print(f"status written {age:.1f} s ago")


def _print_peers(status: dict[str, Any], swarm: dict[str, Any], age: float | None) -> None:
    """The peers the node hears in heartbeats, with the reputation it holds of each."""
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


def _print_joining(status: dict[str, Any]) -> None:
    """How this node joined: tries to reach a peer, time to its first exchange, states
    taken from peers."""
    parts = []
    attempts = status.get("join_attempts")
    if isinstance(attempts, int) and attempts > 1:
        parts.append(f"reached a peer on try {attempts}")
    first = status.get("first_exchange_s")
    if isinstance(first, (int, float)):
        parts.append(f"first exchange {first:.1f} s after launch")
    elif status.get("state") in _RUNNING_STATES:
        parts.append("no exchange with a peer yet")
    count = status.get("catch_ups")
    if isinstance(count, int) and count:
        size = (status.get("catch_up_bytes") or 0) / 2**20
        seconds = status.get("catch_up_seconds") or 0.0
        parts.append(f"took the swarm's state {count} time(s): {size:.1f} MiB in {seconds:.1f} s")
    if status.get("relayed"):
        parts.append("reachable through a relay")
    if parts:
        print("joining: " + "; ".join(parts))


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
    deadline = _deadline_line(status.get("deadlines"))
    if deadline:
        print(deadline)
    if status.get("metrics_url"):
        print(
            f"metrics {status['metrics_url']}/metrics, state {status['metrics_url']}/api/v1/state"
        )
    warning = status.get("control_warning")
    if warning:
        print(f"WARNING: {warning}")
    if status.get("training_alone"):
        print(
            f"WARNING: training alone: no exchange with any peer in the last "
            f"{status.get('alone_rounds')} rounds"
        )
    if status.get("alone_syncs"):
        print(
            f"WARNING: {status['alone_syncs']} sync(s) averaged alone while peers were live; "
            f"last: {status.get('alone_warning')}"
        )


def _deadline_line(deadlines: Any) -> str | None:
    """The exchange budget in force and where it comes from (:mod:`node.train.deadlines`)."""
    if not isinstance(deadlines, dict) or deadlines.get("exchange_seconds") is None:
        return None
    line = f"exchange budget {deadlines['exchange_seconds']:.1f} s"
    measured = deadlines.get("measured_p90")
    if not deadlines.get("adaptive"):
        return line + " (configured; network.adaptive_deadlines is off)"
    if measured is None:
        return line + " (configured, until 4 exchanges completed)"
    line += f" (measured: 90 % of exchanges within {measured:.1f} s"
    backoff = deadlines.get("backoff") or 1
    return line + (f", x{backoff} after exchanges that ran out)" if backoff > 1 else ")")


# ---- peers, ban, pardon ---------------------------------------------------------------------


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


def cmd_peers(args: argparse.Namespace) -> int:
    """``atoll peers``: every peer the node has judged, with its score and standing."""
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


def cmd_operator(args: argparse.Namespace) -> int:
    """``atoll ban`` and ``atoll pardon``: through a running node, or in its files."""
    from node.run.admin import Command, submit

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
