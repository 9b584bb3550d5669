"""The swarm summary's check of the butterfly schedule, on hand-built sync records, and
how the launcher starts a swarm's nodes at once."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from node.ops import swarm
from node.ops.swarm import SwarmSpec, butterfly_reach
from tests.waiting import wait_until
from verification.identity import Identity

ROOT = Path(__file__).resolve().parents[4]

PEERS = ["a", "b", "c", "d"]
# groups of two on the 2 x 2 grid: round 1 pairs along one axis, round 2 the other
PAIRS = {1: [["a", "b"], ["c", "d"]], 2: [["a", "c"], ["b", "d"]]}


def _syncs(rounds: dict[int, list[list[str]]], missing: tuple[str, int] | None = None) -> dict:
    out: dict[str, list[dict]] = {p: [] for p in PEERS}
    for r, groups in rounds.items():
        for group in groups:
            for p in group:
                if (p, r) == missing:
                    continue
                out[p].append(
                    {
                        "round": r,
                        "fragment": 0,
                        "group": group,
                        "contributors": [group, group],  # two parts, every member in each
                        "complete": True,
                        "global_digest": f"{r}:{'-'.join(group)}",
                    }
                )
    return out


def test_two_rounds_of_pairs_mix_four_nodes() -> None:
    found = butterfly_reach(_syncs(PAIRS), group_size=2)
    assert found["rounds_to_mix"] == 2
    assert (found["windows"], found["windows_mixed"]) == (1, 1)
    assert found["reach_share"] == 1.0
    assert (found["groups"], found["groups_agreeing"]) == (4, 4)


def test_the_same_pairs_twice_do_not_mix() -> None:
    found = butterfly_reach(_syncs({1: PAIRS[1], 2: PAIRS[1]}), group_size=2)
    assert (found["windows"], found["windows_mixed"]) == (1, 0)
    assert found["reach_share"] == 0.5  # each node holds itself and its partner: 8 of 16


def test_a_node_that_missed_a_sync_breaks_the_window_and_its_group() -> None:
    found = butterfly_reach(_syncs(PAIRS, missing=("c", 2)), group_size=2)
    assert (found["windows"], found["windows_mixed"]) == (1, 0)
    # round 2's group of a and c is left out of the agreement count: c did not sync
    assert found["groups"] == 3


def test_members_that_hold_different_copies_are_counted() -> None:
    syncs = _syncs(PAIRS)
    syncs["a"][0]["global_digest"] = "another"
    assert butterfly_reach(syncs, group_size=2)["groups_agreeing"] == 3


def test_a_swarm_on_the_cell_grid_promises_no_exact_window() -> None:
    assert butterfly_reach(_syncs(PAIRS), group_size=2, cells_above=4)["rounds_to_mix"] == 2
    found = butterfly_reach(_syncs(PAIRS), group_size=2, cells_above=3)
    # no exact window: windows of ceil(log_2 4) = 2 rounds are followed for their reach
    assert found["rounds_to_mix"] is None and found["window"] == 2
    assert (found["windows"], found["reach_share"]) == (1, 1.0)
    found = butterfly_reach(_syncs({1: PAIRS[1], 2: PAIRS[1]}), group_size=2, cells_above=3)
    assert found["reach_share"] == 0.5


def _spec(tmp_path: Path, overrides: tuple[str, ...] = (), extra: dict | None = None) -> SwarmSpec:
    return SwarmSpec(3, [], list(overrides), tmp_path / "swarm", 2, dict(extra or {}))


def test_the_first_nodes_address_is_known_before_it_runs(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    port, peers = swarm._first_address(spec)
    key = Identity.load(spec.directory / "node0" / "identity.key")
    assert peers == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{key.peer_id}"]
    assert 20000 <= port < 32768  # below the ephemeral range: nobody else is handed it
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # and it was free
    # the first node gets that port; the others join through it
    first = swarm._node_command(spec, 0, spec.directory / "node0", [], [f"network.port={port}"])
    other = swarm._node_command(spec, 1, spec.directory / "node1", peers)
    assert f"network.port={port}" in first and "--initial-peers" not in first
    assert other[other.index("--initial-peers") + 1] == peers[0]


@pytest.mark.parametrize(
    "overrides, extra",
    [
        (("network.port=4001",), None),  # the operator chose the port
        (("network.host='0.0.0.0'",), None),  # not only this machine's loopback
        ((), {2: ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x"]}),
        ((), {0: ["--spec", "run.toml"]}),
    ],
)
def test_a_swarm_whose_first_address_the_launcher_cannot_choose_starts_it_alone(
    tmp_path: Path, overrides: tuple[str, ...], extra: dict | None
) -> None:
    assert swarm._first_address(_spec(tmp_path, overrides, extra)) is None


def test_a_port_already_taken_is_never_chosen(tmp_path: Path, monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(swarm.random, "randint", lambda a, b: busy)
        assert swarm._free_port(tries=3) is None
        assert swarm._first_address(_spec(tmp_path)) is None


def test_a_swarm_directory_used_before_keeps_the_first_nodes_peer_id(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    _, before = swarm._first_address(spec)
    _, again = swarm._first_address(spec)
    assert before[0].split("/p2p/")[1] == again[0].split("/p2p/")[1]


def _exiting(tmp_path: Path, index: int, after: float, code: int) -> swarm.SwarmProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; time.sleep({after}); sys.exit({code})"]
    )
    return swarm.SwarmProcess(index, tmp_path / f"node{index}", proc, None)


def test_nodes_started_together_that_fail_alike_are_named_by_the_first(tmp_path: Path) -> None:
    # node 1 fails first, node 0 (still coming up) a moment later, as a swarm without a
    # corpus does: the first node is named, not whichever exited first
    nodes = [_exiting(tmp_path, 0, 0.6, 2), _exiting(tmp_path, 1, 0.0, 2)]
    with pytest.raises(swarm.NodeFailed) as failed:
        swarm.wait_for_maddrs(nodes[0], timeout=20, others=nodes[1:])
    assert failed.value.index == 0
    # a node that fails alone is named while the first is still coming up
    nodes = [_exiting(tmp_path, 0, 30, 0), _exiting(tmp_path, 1, 0.0, 2)]
    try:
        with pytest.raises(swarm.NodeFailed) as failed:
            swarm.wait_for_maddrs(nodes[0], timeout=20, others=nodes[1:])
        assert failed.value.index == 1
    finally:
        nodes[0].proc.kill()
        nodes[0].proc.wait()


_LAUNCHER = """
import subprocess, sys, time
from node.ops.swarm import interrupt_on_sigterm
interrupt_on_sigterm()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
try:
    print(child.pid, flush=True)  # inside the try: a signal after it finds the finally armed
    time.sleep(60)
finally:
    child.terminate()
    child.wait(10)
"""


def test_a_launcher_sent_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    """Without :func:`node.ops.swarm.interrupt_on_sigterm` SIGTERM ends a launcher at once,
    its ``finally`` unrun, and the node it started lives on."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        child = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) != 0
        assert wait_until(lambda: not psutil.pid_exists(child), 10), "the child outlived it"
    finally:
        launcher.kill()
        launcher.wait(10)
