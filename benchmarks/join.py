"""Joining a run by its address: how often it works, and how long it takes.

A bootstrap node runs from a signed run spec (the test settings of
``tests/integration/conftest.py``: a small byte model, ``steps`` rounds of 10 inner
steps) and serves it; volunteers then join one after another with ``atoll run --join
RUN_ID@MULTIADDR`` alone, each stopped once it exchanged with the bootstrap node (or
after 120 s). Each join is judged by what the volunteer reports (its join figures,
``docs/operating.md``): it succeeded when the node exchanged with the bootstrap node and
exited 0 when stopped. Per join: the seconds from launch to
its first exchange, the tries its start took to reach the bootstrap, the states it took
from the swarm (bytes, seconds), and the wall time from launch to its first exchange.

Rows: on 127.0.0.1; on 127.0.0.1 with every Atoll message (matchmaking, all-reduce,
catch-up, the spec fetch) delayed 100 ms one way by each sender
(``protocol.p2p.shaper``; the DHT's and p2pd's own traffic is not delayed, and the
kernel here has no netem to do it below them); and (as root, where the network lab can
be built) a volunteer behind a masquerading NAT router joining a public bootstrap host
(``tests/netlab.py``). Owning parts through a relay is measured by
:mod:`benchmarks.relay`.

Run ``python -m benchmarks join [--quick]`` (quick: 3 joins per row; full: 10;
``--smoke``: 1 join on 127.0.0.1); writes ``join.json`` and ``join.png``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from benchmarks._common import figure, free_port, machine_info
from benchmarks._mode import Mode
from protocol.p2p.shaper import ENV_VAR

__all__ = ["run"]

_RUN_ID = "join-bench"
_DELAYED = "127.0.0.1, 100 ms one way"
_PORT = 31337  # on a lab host, which has its own network stack


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Every row's joins, the report and its figure."""
    from tests.netlab import netlab_available

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    joins = 1 if mode.smoke else 3 if mode.quick else 10
    rows = {"127.0.0.1": _local(joins)}
    lab, why = netlab_available()
    if mode.smoke:
        rows_skipped = {name: "not in a smoke run" for name in (_DELAYED, "behind NAT")}
    else:
        rows[_DELAYED] = _local(joins, {ENV_VAR: "delay_ms=100"})
        rows_skipped = {}
        if lab:
            rows["behind NAT"] = _behind_nat(joins)
        else:
            rows_skipped["behind NAT"] = f"the network lab is unavailable: {why}"
    report = {
        "benchmark": "join",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "machine": machine_info(),
        "command": f"python -m benchmarks join{' --quick' if mode.quick else ''}",
        "rows": {name: _summary(results) for name, results in rows.items()},
        "joins": rows,
        "rows_not_run": rows_skipped,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out_dir / "join.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "join.png")
    return report


def _overrides() -> list[str]:
    from tests.integration.conftest import SMALL

    return [o for o in SMALL if not o.startswith("run.run_id")] + [f"run.run_id='{_RUN_ID}'"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=120
    )


def _make_spec(root: pathlib.Path, host: str, port: int) -> tuple[pathlib.Path, str]:
    """The bootstrap's key and the signed spec naming it; returns the spec and the run
    address."""
    from verification.identity import Identity

    key = root / "node0" / "identity.key"
    key.parent.mkdir(parents=True)
    boot = Identity.generate()
    boot.save(key)
    maddr = f"/ip4/{host}/tcp/{port}/p2p/{boot.peer_id}"
    spec = root / "run.toml"
    sets = [a for o in _overrides() for a in ("--set", o)]
    done = _cli(
        "spec", "create", *sets, "--key", str(key), "--bootstrap", maddr, "--out", str(spec)
    )
    if done.returncode != 0:
        raise RuntimeError(f"spec create failed: {done.stderr.strip()}")
    return spec, f"{_RUN_ID}@{maddr}"


def _joins(
    start: Callable[[int, list[str], int], Any], spec: pathlib.Path, address: str, n: int
) -> list[dict[str, Any]]:
    """The bootstrap node (index 0) started, then ``n`` volunteers one after another,
    each stopped (SIGTERM) once it exchanged with the bootstrap node, or after 120 s;
    all run until stopped (``--rounds`` counts the run's rounds, which the bootstrap
    node is far into by the later joins)."""
    from node.ops import swarm
    from tests.waiting import wait_until

    boot = start(0, ["--spec", str(spec)], 0)
    results = []
    try:
        for i in range(1, n + 1):
            started = time.monotonic()
            node = start(i, ["--join", address], 0)
            wait_until(functools.partial(_joined_or_gone, node), 120)
            wall = time.monotonic() - started
            swarm.stop_all([node], grace=20)
            results.append(_result(node, wall))
            print(f"join: volunteer {i}: {results[-1]}", flush=True)
    finally:
        swarm.stop_all([boot], grace=20)
    return results


def _joined_or_gone(node: Any) -> bool:
    return node.proc.poll() is not None or "first_exchange_s" in node.status


def _result(node: Any, wall: float) -> dict[str, Any]:
    status, code = node.status, node.proc.returncode
    first = status.get("first_exchange_s")
    return {
        "exit_code": code,
        "succeeded": code == 0 and first is not None,
        "first_exchange_s": first,
        "join_attempts": status.get("join_attempts"),
        "catch_ups": status.get("catch_ups", 0),
        "catch_up_bytes": status.get("catch_up_bytes", 0),
        "catch_up_seconds": status.get("catch_up_seconds", 0.0),
        "reachability": (status.get("reachability") or {}).get("status"),
        "wall_s": round(wall, 1),
    }


def _local(n: int, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Joins on 127.0.0.1; ``env``: extra environment of every node (a link shape)."""
    from node.ops import swarm

    with tempfile.TemporaryDirectory(prefix="atoll-join-") as tmp:
        root, port = pathlib.Path(tmp), free_port()
        spec, address = _make_spec(root, "127.0.0.1", port)

        def start(index: int, args: list[str], rounds: int) -> Any:
            sets = [f"network.port={port}"] if index == 0 else []
            plan = _plan(root, index, args, rounds, sets, env or {})
            return swarm.start_node(plan, index, [])

        return _joins(start, spec, address, n)


def _behind_nat(n: int) -> list[dict[str, Any]]:
    from node.ops import swarm
    from tests.netlab import NetLab, cleanup_stale

    cleanup_stale()
    with NetLab() as lab, tempfile.TemporaryDirectory(prefix="atoll-join-nat-") as tmp:
        root = pathlib.Path(tmp)
        lab.add_host("a")
        lab.add_nat_host("d")
        spec, address = _make_spec(root, lab.hosts["a"].ip, _PORT)

        def start(index: int, args: list[str], rounds: int) -> Any:
            host = lab.hosts["a" if index == 0 else "d"]
            sets = [f"network.host='{host.ip}'", f"network.port={_PORT}"]
            plan = _plan(root, index, args, rounds, sets)
            return swarm.start_node(plan, index, [], popen=functools.partial(lab.popen, host))

        return _joins(start, spec, address, n)


def _plan(
    root: pathlib.Path,
    index: int,
    args: list[str],
    rounds: int,
    sets: list[str],
    env: dict[str, str] | None = None,
) -> Any:
    """Node ``index`` of a row: the test settings, ``sets``, its own arguments and
    environment."""
    from node.ops import swarm

    return swarm.SwarmSpec(
        nodes=2,
        config_paths=[],
        overrides=[*_overrides(), *sets],
        directory=root,
        rounds=rounds,
        extra_args={index: args},
        env=env or {},
    )


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["succeeded"]]
    firsts = [r["first_exchange_s"] for r in ok]
    return {
        "joins": len(results),
        "succeeded": len(ok),
        "first_exchange_s_median": statistics.median(firsts) if firsts else None,
        "first_exchange_s_max": max(firsts) if firsts else None,
        "catch_up_bytes_median": statistics.median(r["catch_up_bytes"] for r in ok) if ok else None,
    }


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, figsize=(7, 3), dpi=110) as (fig, ax):
        for y, results in enumerate(report["joins"].values()):
            ok = [r["first_exchange_s"] for r in results if r["succeeded"]]
            failed = [r for r in results if not r["succeeded"]]
            ax.scatter(ok, [y] * len(ok), color="#2a7", label="joined" if y == 0 else None)
            if failed:
                ax.scatter([0] * len(failed), [y] * len(failed), color="#a22", marker="x")
        ax.set_yticks(range(len(report["joins"])), list(report["joins"]))
        ax.set_xlabel("seconds from launch to first exchange")
        ax.set_title("joining a run by its address")
        ax.legend()
