"""Owning parts through a relay: what the relay carries, and what it costs a round.

Two rows of three nodes in the network lab (``tests/netlab.py``), with the test settings
of ``tests/integration/conftest.py`` in 20-s wall-clock rounds, 15 of them, groups of 3:

* ``direct``: a public host ``r`` runs the first node; two volunteers run on public
  hosts of their own;
* ``relay``: the same, but each volunteer sits behind its own masquerading NAT router
  and runs with ``network.relay_parts`` (:mod:`protocol.p2p.relays`): a client until
  its p2pd holds a slot on ``r`` (about 3 minutes), then an owner reached through it.

Per row: the bytes each host's link moved (its interface counters, both ways), in all
and from round 10 on (the volunteers own parts by then in both rows), the exchanges in
which a volunteer owned a part, and the median seconds of an exchange (the ``sync``
events' ``seconds``) in the rounds after both volunteers own parts. In the ``relay``
row every byte between the volunteers goes through ``r``: from round 10 on, its link's
bytes beyond the ``direct`` row's are what it relayed.

Run ``python -m benchmarks relay [--quick]`` as root (the lab needs network namespaces
and nftables; without them the rows are listed as not run). Quick and full run the same
15 rounds (the slot takes 3 of the 5 minutes); ``--smoke`` runs no row. Writes
``relay.json`` and ``relay.png``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import tempfile
from datetime import datetime, timezone
from typing import Any

from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode

__all__ = ["run", "start_three"]

_PORT = 31337
_ROUNDS = 15
_SETTINGS = [
    "sync.trigger='seconds'",
    "sync.round_seconds=20",
    "network.group_size=3",
    "network.min_peers=3",
]
_ROWS = ("direct", "relay")
_FROM = 10
"""The first round whose link bytes are counted apart (the volunteers own parts by
then in both rows)."""


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Both rows (none in a smoke run), the report and its figure."""
    from tests.netlab import netlab_available

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lab, why = netlab_available()
    rows: dict[str, Any] = {}
    if mode.smoke:
        skipped = dict.fromkeys(_ROWS, "not in a smoke run")
    elif not lab:
        skipped = dict.fromkeys(_ROWS, f"the network lab is unavailable: {why}")
    else:
        skipped = {}
        for name in _ROWS:
            rows[name] = _row(relayed=name == "relay")
            print(f"relay: {name}: {json.dumps(rows[name]['summary'])}", flush=True)
    report = {
        "benchmark": "relay",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "machine": machine_info(),
        "command": f"python -m benchmarks relay{' --quick' if mode.quick else ''}",
        "rounds": _ROUNDS,
        "settings": _SETTINGS,
        "rows": rows,
        "rows_not_run": skipped,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if rows:
        direct, relay = rows.get("direct"), rows.get("relay")
        if direct and relay:
            # from round _FROM on both rows' volunteers own parts: what r's link moved
            # beyond the direct row's is what it relayed
            late = relay["bytes_from_round"]["r"] - direct["bytes_from_round"]["r"]
            report["relayed_bytes"] = late
            report["relay_link_ratio"] = round(
                relay["bytes_from_round"]["r"] / max(1, direct["bytes_from_round"]["r"]), 3
            )
            d, r = direct["summary"]["exchange_s_median"], relay["summary"]["exchange_s_median"]
            report["exchange_ratio"] = round(r / d, 3) if d and r else None
    (out_dir / "relay.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "relay.png")
    return report


def _row(relayed: bool) -> dict[str, Any]:
    """One row's three nodes, run to the end."""
    from node.ops import swarm
    from tests.netlab import NetLab, cleanup_stale
    from tests.waiting import wait_until

    cleanup_stale()
    with NetLab() as lab, tempfile.TemporaryDirectory(prefix="atoll-relay-") as tmp:
        root = pathlib.Path(tmp)
        lab.add_host("r")
        for name in ("v1", "v2"):
            (lab.add_nat_host if relayed else lab.add_host)(name)
        before = {h: _link_bytes(lab, h) for h in ("r", "v1", "v2")}
        nodes: list[Any] = []
        try:
            start_three(lab, root, ("r", "v1", "v2"), relayed, _ROUNDS, nodes)
            # the relay's slot is held from about 200 s (round 10 of 20-s rounds) on
            wait_until(lambda: nodes[0].status.get("round", 0) >= _FROM - 1, 600, 1.0)
            middle = {h: _link_bytes(lab, h) for h in before}
            wait_until(lambda: all(n.proc.poll() is not None for n in nodes), 600, 2.0)
        finally:
            swarm.stop_all([n for n in nodes if not n.log.closed], grace=20)
        after = {h: _link_bytes(lab, h) for h in before}
        moved = {h: after[h] - before[h] for h in before}
        late = {h: after[h] - middle[h] for h in before}
        return _measure(nodes, moved, late)


def start_three(
    lab: Any,
    root: pathlib.Path,
    hosts: tuple[str, str, str],
    relayed: bool,
    rounds: int,
    nodes: list[Any],
) -> None:
    """Start a row's three nodes on ``hosts`` of ``lab`` into ``nodes`` (the caller
    stops them): the first, public, makes its key first and is everyone's bootstrap
    and relay; the other two run with ``network.relay_parts`` where ``relayed``."""
    from node.ops import swarm
    from verification.identity import Identity

    key = root / "node0" / "identity.key"
    key.parent.mkdir(parents=True)
    boot = Identity.generate()
    boot.save(key)
    bootstrap = f"/ip4/{lab.hosts[hosts[0]].ip}/tcp/{_PORT}/p2p/{boot.peer_id}"
    for index, host in enumerate(hosts):
        mine = ["network.relay_parts=true"] if relayed and index else []
        where = [f"network.host='{lab.hosts[host].ip}'", f"network.port={_PORT}"]
        plan = swarm.SwarmSpec(
            nodes=3,
            config_paths=[],
            overrides=[*_overrides(), *mine, *where],
            directory=root,
            rounds=rounds,
        )
        popen = functools.partial(lab.popen, lab.hosts[host])
        peers = [bootstrap] if index else []
        nodes.append(swarm.start_node(plan, index, peers, popen=popen))


def _overrides() -> list[str]:
    from tests.integration.conftest import SMALL

    return [*SMALL, *_SETTINGS]


def _link_bytes(lab: Any, host: str) -> int:
    """Bytes in and out of ``host``'s link so far."""
    total = 0
    for way in ("rx", "tx"):
        done = lab.run(lab.hosts[host], ["cat", f"/sys/class/net/eth0/statistics/{way}_bytes"])
        total += int(done.stdout.strip())
    return total


def _measure(
    nodes: list[Any], moved: dict[str, int], late: dict[str, int] | None = None
) -> dict[str, Any]:
    from node.run.metrics import read_events

    ids = [n.status.get("peer_id", "") for n in nodes]
    owned: dict[str, list[int]] = {}
    syncs = {}
    for node, me in zip(nodes, ids, strict=True):
        syncs[me] = read_events(node.data_dir / "events.jsonl", "sync")
        owned[me] = sorted({s["round"] for s in syncs[me] if me in s["owners"]})
    volunteers = ids[1:]
    both = max((min(owned[v], default=10**9) for v in volunteers), default=10**9)
    seconds = [
        s["seconds"] for v in volunteers for s in syncs[v] if s["round"] >= both and s["complete"]
    ]
    reach = [(n.status.get("reachability") or {}).get("status") for n in nodes]
    return {
        "exit_codes": [n.proc.returncode for n in nodes],
        "reachability": reach,
        "bytes": moved,
        "bytes_from_round": {"round": _FROM, **(late or {})},
        "owned_rounds": {v[:16]: owned[v] for v in volunteers},
        "summary": {
            "volunteers_own_from_round": both if both < 10**9 else None,
            "exchanges_measured": len(seconds),
            "exchange_s_median": round(statistics.median(seconds), 3) if seconds else None,
            "relay_link_bytes": moved["r"],
            "relay_link_bytes_late": (late or {}).get("r"),
        },
    }


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    rows = report["rows"]
    with figure(path, 1, 2, figsize=(8, 3), dpi=110) as (fig, axes):
        names = list(rows)
        axes[0].bar(names, [rows[n]["bytes"]["r"] / 1e6 for n in names], color="#47a")
        axes[0].set_ylabel("MB through r's link")
        medians = [rows[n]["summary"]["exchange_s_median"] or 0 for n in names]
        axes[1].bar(names, medians, color="#a74")
        axes[1].set_ylabel("median exchange (s)")
        fig.suptitle("owning parts through a relay")
