"""Whether a node's global copy is the swarm's, from the digests its peers report, and
which of several states a swarm converges on."""

from __future__ import annotations

from node.train.agreement import AgreementWatch, swarm_state

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _round(watch: AgreementWatch, r: int, mine: str, theirs: dict[str, str]) -> None:
    watch.own(r, mine)
    for peer, digest in theirs.items():
        watch.heard(peer, [r, digest])


def test_two_rounds_apart_from_most_peers_ask_for_the_swarms_state() -> None:
    watch = AgreementWatch(rounds=2)
    _round(watch, 1, A, {"p": A, "q": A})
    assert watch.check(2) is None  # round 1 agreed
    _round(watch, 2, B, {"p": A, "q": A})
    assert watch.check(3) is None  # one round apart: maybe a re-sync under way
    _round(watch, 3, B, {"p": A, "q": A})
    why = watch.check(4)
    assert why is not None and "2 of 2 peers" in why and "round 3" in why
    assert watch.check(4) is None  # said once per round
    _round(watch, 4, A, {"p": A, "q": A})
    assert watch.check(5) is None


def test_a_tie_is_lost_by_the_larger_digest_only() -> None:
    # two nodes that disagree: exactly one of them takes the other's state
    low, high = AgreementWatch(rounds=1), AgreementWatch(rounds=1)
    _round(low, 1, A, {"high": B})
    _round(high, 1, B, {"low": A})
    assert low.check(2) is None
    assert high.check(2) is not None


def test_no_verdict_while_this_node_holds_the_most_common_state_or_without_reports() -> None:
    watch = AgreementWatch(rounds=1)
    _round(watch, 1, C, {"p": B, "q": C, "r": A, "s": "d" * 64})
    assert watch.check(2) is None  # C: this node and q; every other digest has one
    watch.own(2, C)
    assert watch.check(3) is None  # nobody reported round 2
    _round(watch, 3, C, {"p": B})
    assert watch.check(4) is not None  # one against one: the smaller digest wins


def test_what_peers_report_is_checked_before_it_counts() -> None:
    watch = AgreementWatch(rounds=1)
    watch.own(1, B)
    for bad in (None, "x", [1], [True, A], [0, A], [1, "A" * 64], [1, A[:10]], (1, 2)):
        watch.heard("p", bad)
    assert watch.check(2) is None
    for r in range(1, 10):  # old rounds are forgotten
        _round(watch, r, A, {"p": A})
    assert min(watch._own) >= 6 and min(watch._peers) >= 6


def test_the_swarms_state_is_the_most_settled_then_the_most_signed_then_the_smallest() -> None:
    assert swarm_state({}) is None
    # settled signers first: one settled peer beats two that lost a sync
    assert swarm_state({A: {"p": "unsettled", "q": "unsettled"}, B: {"r": "settled"}}) == B
    # then signers of any kind
    assert swarm_state({A: {"p": "unsettled"}, B: {"q": "unsettled", "r": "unsettled"}}) == B
    assert swarm_state({A: {"p": "settled"}, C: {"q": "settled", "r": "unsettled"}}) == C
    # then the smallest digest: every node that reads the same signatures picks the same
    assert swarm_state({B: {"p": "unsettled"}, A: {"q": "unsettled"}}) == A
    assert swarm_state({C: {"p": "settled"}, B: {"q": "settled"}, A: {"r": "unsettled"}}) == B


def test_a_joining_nodes_state_is_never_the_swarms() -> None:
    assert swarm_state({A: {"new": "joining"}}) is None
    assert swarm_state({A: {"new": "joining", "p": "joining"}, B: {"q": "unsettled"}}) == B
    assert swarm_state({A: {"new": "joining", "p": "unsettled"}, B: {"q": "unsettled"}}) == A
