"""Tests for node.daemon that need no network: how a finished node judges its run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.config import load_config
from node.daemon import Node, PastLastRound, TrainedAlone
from verification.identity import Identity

PEER = f"/ip4/127.0.0.1/tcp/4001/p2p/{Identity.from_seed(b'p' * 32).peer_id}"


def _finished(initial_peers: tuple[str, ...], exchanges: int, rounds: int = 3) -> Node:
    node = Node(load_config(None, ["run.max_rounds=3"]), initial_peers=initial_peers)
    node.progress.clock.finish(rounds)
    node.progress.exchanges = exchanges
    return node


def _network(refused: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(peers=SimpleNamespace(refused=lambda: dict(refused or {})))


def test_a_node_that_joined_and_never_exchanged_ends_with_an_error() -> None:
    node = _finished((PEER,), exchanges=0)
    with pytest.raises(TrainedAlone, match=r"trained 3 round\(s\) without one exchange"):
        node._check_not_alone(_network())
    stranger = {"12D3KooWx": "spec_mismatch: runs spec abc, this node runs def"}
    with pytest.raises(TrainedAlone, match=r"1 peer\(s\) refused as on another spec"):
        node._check_not_alone(_network(stranger))


@pytest.mark.parametrize(
    "initial_peers, exchanges, rounds, stopped",
    [
        ((PEER,), 1, 3, False),  # it exchanged once: it took part
        ((), 0, 3, False),  # it started the swarm and nobody came: a warning, not an error
        ((PEER,), 0, 2, False),  # it did not finish its rounds
        ((PEER,), 0, 3, True),  # stopped by a signal
    ],
)
def test_no_error_for_a_node_that_took_part_started_the_swarm_or_was_stopped(
    initial_peers: tuple[str, ...], exchanges: int, rounds: int, stopped: bool
) -> None:
    node = _finished(initial_peers, exchanges, rounds)
    if stopped:
        node.stop_event.set()
    node._check_not_alone(_network())


@pytest.mark.parametrize(
    "initial_peers, at, source",
    [((PEER,), 7, "the swarm's state"), ((), 3, "its checkpoint")],
)
def test_a_node_that_starts_at_or_past_its_last_round_says_it_has_nothing_to_train(
    initial_peers: tuple[str, ...], at: int, source: str
) -> None:
    node = _finished(initial_peers, exchanges=0, rounds=at)
    with pytest.raises(PastLastRound, match=f"starts at round {at} \\({source}\\)") as raised:
        node._check_rounds_left()
    assert "--rounds counts the run's rounds" in str(raised.value)
    node.progress.clock.finish(2)  # rounds left: it trains
    node._check_rounds_left()
    endless = Node(load_config(None, []), initial_peers=initial_peers)
    endless.progress.clock.finish(50)
    endless._check_rounds_left()  # run.max_rounds = 0: no last round


def test_a_split_attacker_needs_a_gather_to_attack() -> None:
    with pytest.raises(ValueError, match="--byzantine split attacks a gather"):
        Node(load_config(None, []), byzantine="split")
    topk = ["sync.codec='topk'", "sync.exchange='gather'"]
    assert Node(load_config(None, topk), byzantine="split").byzantine == "split"


def test_the_node_stops_when_its_upkeep_ends_with_a_reason_and_only_then() -> None:
    from concurrent.futures import Future

    node = _finished((), exchanges=0)
    stopped: Future = Future()
    stopped.set_result(None)  # the node stopped: nothing to act on
    failed: Future = Future()
    failed.set_exception(RuntimeError("a bug in the upkeep"))
    for ended in (stopped, failed):
        node._upkeep_ended(ended)
        assert not node.stop_event.is_set()
    ended: Future = Future()
    ended.set_result("another node is running with the identity key /data/identity.key")
    node._upkeep_ended(ended)
    assert node.stop_event.is_set()
