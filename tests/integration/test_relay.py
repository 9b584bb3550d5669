"""Two volunteers, each behind its own masquerading NAT, own parts through a public relay.

Host ``r`` is public and runs the first node, which is also the relay (p2pd relays
by default); ``d1`` and ``d2`` sit behind NAT routers of their own and run with
``network.relay_parts``. Neither can dial the other, nor can ``r`` dial them. Once their
p2pd holds a slot on the relay (about 3 minutes after start) each claims its circuit
address, and from then on both own parts: each one's audit log holds the other's parts,
which could only have come through the relay. Slow (about five minutes): ``make
test-all``. The swarm is the relay benchmark's (:func:`benchmarks.relay.start_three`),
which measures the relay's bytes against the direct path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.relay import start_three
from node.ops import swarm
from node.run.metrics import read_events
from tests.integration.conftest import wait_until
from tests.netlab import NetLab
from verification.audit import AuditLog

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 15


def _senders(node: swarm.SwarmProcess) -> dict[str, set[int]]:
    log = AuditLog(node.data_dir / "atoll.db")
    try:
        rows = log.rows()
    finally:
        log.close()
    out: dict[str, set[int]] = {}
    for row in rows:
        if row.verdict == "accepted":
            out.setdefault(row.sender, set()).add(row.round)
    return out


def test_two_volunteers_behind_nat_own_parts_through_a_relay(
    netlab: NetLab, tmp_path: Path
) -> None:
    netlab.add_host("r")
    for name in ("d1", "d2"):
        netlab.add_nat_host(name)
    nodes: list[swarm.SwarmProcess] = []
    try:
        start_three(netlab, tmp_path, ("r", "d1", "d2"), True, ROUNDS, nodes)
        done = wait_until(lambda: all(n.proc.poll() is not None for n in nodes), 540, 2.0)
        assert done, "nodes did not finish within 540 s"
    finally:
        swarm.stop_all([n for n in nodes if not n.log.closed], grace=20)
    bootstrap = nodes[0].status["maddrs"][0]  # the relay: the first node's address
    assert [n.proc.returncode for n in nodes] == [0, 0, 0]
    ids = [n.status["peer_id"] for n in nodes]
    for node in nodes[1:]:
        found = node.status["reachability"]
        assert found["status"] == "relayed", found
        assert found["circuits"] == [f"{bootstrap}/p2p-circuit/p2p/{node.status['peer_id']}"]
        assert node.status["relayed"] is True
    # before the claim each volunteer was a client; after it, both own parts
    owned = {}
    for node, me in zip(nodes[1:], ids[1:], strict=True):
        syncs = read_events(node.data_dir / "events.jsonl", "sync")
        owned[me] = sorted({s["round"] for s in syncs if me in s["owners"] and s["complete"]})
        assert owned[me], f"{me[:16]} never owned a part"
        assert any(me not in s["owners"] for s in syncs if s["round"] == 1)
    # each volunteer's audit log holds the other's parts: they came through the relay
    d1, d2 = _senders(nodes[1]), _senders(nodes[2])
    assert set(owned[ids[1]]) & d1.get(ids[2], set()), (owned, d1)
    assert set(owned[ids[2]]) & d2.get(ids[1], set()), (owned, d2)
    # and every node ended on one state
    last = [
        next(e for e in reversed(read_events(n.data_dir / "events.jsonl", "round"))) for n in nodes
    ]
    assert len({e["global_digest"] for e in last}) == 1, last
