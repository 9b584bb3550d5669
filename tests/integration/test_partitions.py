"""A flapping link: one host of three loses its cable for 5 s every 20 s for a minute.

The flapping node rejoins within two rounds of each return of its link and ends
agreeing bitwise with the others; the two stable nodes agree every round. Each cut
falls on another moment of a round (:data:`OFFSETS`): a fragment's matchmaking, its
all-reduce after the groups formed, and the moment both fragments' syncs overlap.
Run through ``flap_run`` here once; ``python -m benchmarks partitions`` repeats it with
cuts at random moments (it is not luck).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from node.run.metrics import read_events
from tests.integration.conftest import SMALL
from tests.integration.test_multihost import PORT, LabNodes, _cli, _sets
from tests.netlab import NetLab
from verification.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(420)]

ROUND_SECONDS = 10.0
ROUNDS = 10
# the link goes down DOWN_SECONDS in each window of FLAP_SECONDS from round 2, then stays up
DOWN_SECONDS = 5.0
FLAP_SECONDS = 20.0
OFFSETS = (0.0, 3.5, 6.5)
"""Seconds into its 20-s window each cut begins: at a round's start (fragment 1's
matchmaking), just after matchmaking (its all-reduce), and over fragment 0's exchange
into fragment 1's matchmaking."""
SETTINGS = [
    *[s for s in SMALL if not s.startswith("sync.trigger")],
    "sync.trigger='seconds'",
    f"sync.round_seconds={ROUND_SECONDS}",
    "network.matchmaking_seconds=3",
    "network.round_timeout=5",
    "network.request_timeout=4",
    "control.commit_seconds=2",
]


def flap_run(lab: NetLab, root: Path, offsets: tuple[float, ...] = OFFSETS) -> dict:
    """Three hosts, one flapping (cut ``offsets[i]`` s into window ``i``); what each
    node's rounds said, and when the link was down."""
    for name in "abc":
        lab.add_host(name)
    key = root / "node0" / "identity.key"
    key.parent.mkdir(parents=True)
    boot = Identity.generate()
    boot.save(key)
    bootstrap = f"/ip4/{lab.hosts['a'].ip}/tcp/{PORT}/p2p/{boot.peer_id}"
    t0 = float(int(time.time()) + 45)  # time for the three nodes to start
    spec = root / "run.toml"
    made = _cli("spec", "create", *_sets(SETTINGS), "--key", str(key), "--bootstrap", bootstrap,
                "--t0", str(t0), "--out", str(spec))  # fmt: skip
    assert made.returncode == 0, made.stderr
    nodes = LabNodes(lab, root)
    downs: list[tuple[float, float]] = []
    stop = threading.Event()

    def flap() -> None:
        start = t0 + ROUND_SECONDS  # from round 2
        for i, offset in enumerate(offsets):
            at = start + i * FLAP_SECONDS + offset
            if stop.wait(max(0.0, at - time.time())):
                return
            lab.set_link(lab.hosts["c"], up=False)
            down = time.time()
            stop.wait(DOWN_SECONDS)
            lab.set_link(lab.hosts["c"], up=True)
            downs.append((down, time.time()))

    flapper = threading.Thread(target=flap, daemon=True)
    try:
        for index, host in enumerate("abc"):
            nodes.start(index, host, SETTINGS, ["--spec", str(spec)], nodes=3, rounds=ROUNDS)
        flapper.start()
        finished = nodes.wait(t0 - time.time() + ROUNDS * ROUND_SECONDS + 120)
    finally:
        stop.set()
        flapper.join(timeout=10)
        lab.set_link(lab.hosts["c"], up=True)
        nodes.close()
    rounds = [
        {e["round"]: e for e in read_events(n.data_dir / "events.jsonl", "round")}
        for n in nodes.nodes
    ]
    return {
        "finished": finished,
        "exit_codes": [n.proc.returncode for n in nodes.nodes],
        "rounds": rounds,
        "downs": downs,
        "t0": t0,
        "nodes": nodes.nodes,
    }


def judge(run: dict) -> dict:
    """Which rounds the flapping node should agree in (its link up since two rounds before
    the round began), and where anyone disagreed."""
    t0, downs = run["t0"], run["downs"]
    a, b, c = run["rounds"]
    stable_apart = [
        r for r in range(1, ROUNDS + 1) if a[r]["global_digest"] != b[r]["global_digest"]
    ]
    due, late = [], []
    for r in range(1, ROUNDS + 1):
        start, end = t0 + (r - 1) * ROUND_SECONDS, t0 + r * ROUND_SECONDS
        # the link was up from two rounds before this round began to its end
        clear = all(up < start - 2 * ROUND_SECONDS or down > end for down, up in downs)
        if clear and downs and start > downs[0][0]:
            due.append(r)
            if r not in c or c[r]["global_digest"] != a[r]["global_digest"]:
                late.append(r)
    return {"stable_apart": stable_apart, "due": due, "late": late}


@pytest.mark.slow
def test_a_flapping_node_rejoins_and_ends_agreeing_with_the_stable_ones(netlab, tmp_path) -> None:
    run = flap_run(netlab, tmp_path)
    assert run["finished"] and run["exit_codes"] == [0, 0, 0], run["exit_codes"]
    assert len(run["downs"]) == len(OFFSETS)
    verdict = judge(run)
    assert verdict["stable_apart"] == [], verdict
    assert verdict["due"] and verdict["late"] == [], verdict
    a, _, c = run["rounds"]
    assert c[ROUNDS]["global_digest"] == a[ROUNDS]["global_digest"]
    flapper = run["nodes"][2]
    groups = [len(s["group"]) for s in read_events(flapper.data_dir / "events.jsonl", "sync")]
    assert groups[-2:] == [3, 3], groups  # back in the full group at the end
