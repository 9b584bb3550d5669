"""Deterministic grouping: the pure half of matchmaking (no network)."""

from __future__ import annotations

import hashlib
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.averaging.matchmaking import form_groups, group_of

_peers = st.sets(st.text(min_size=1, max_size=12), min_size=0, max_size=40)
_group_size = st.integers(min_value=1, max_value=12)
_round = st.integers(min_value=0, max_value=2**40)
_fragment = st.integers(min_value=0, max_value=1024)


def _names(n: int) -> list[str]:
    return [f"peer-{i:02d}" for i in range(n)]


def _rank(*fields: object) -> bytes:
    return hashlib.sha256(":".join(str(f) for f in fields).encode()).digest()


def test_five_peers_in_pairs_by_hand() -> None:
    peers = _names(5)
    groups = form_groups(peers, 3, 1, 2)
    # No one is left to average alone: the odd peer joins the first group.
    assert [len(g) for g in groups] == [3, 2]
    # The groups are consecutive slices of the peers ordered by sha256(round:peer), and
    # each group's members are ordered by sha256(round:fragment:peer); every node,
    # whatever its version, must cut the same way.
    ordered = sorted(peers, key=lambda p: _rank(3, p))
    cut = [ordered[0:3], ordered[3:5]]
    assert groups == [sorted(g, key=lambda p: _rank(3, 1, p)) for g in cut]


def test_seven_peers_in_threes_is_three_two_two() -> None:
    groups = form_groups(_names(7), 0, 0, 3)
    assert [len(g) for g in groups] == [3, 2, 2]


def test_group_size_at_least_peer_count_is_one_group() -> None:
    peers = _names(4)
    for size in (4, 5, 100):
        (only,) = form_groups(peers, 0, 0, size)
        assert sorted(only) == peers


def test_group_size_one_is_singletons() -> None:
    groups = form_groups(_names(3), 0, 0, 1)
    assert sorted(g[0] for g in groups) == _names(3)
    assert all(len(g) == 1 for g in groups)


def test_no_peers_no_groups() -> None:
    assert form_groups([], 0, 0, 4) == []


@pytest.mark.parametrize("size", [0, -1])
def test_group_size_below_one_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        form_groups(_names(3), 0, 0, size)


def test_duplicates_in_input_count_once() -> None:
    peers = _names(5)
    assert form_groups(peers + peers[:3], 2, 0, 2) == form_groups(peers, 2, 0, 2)


@given(peers=_peers, round_=_round, fragment=_fragment, size=_group_size, seed=st.integers())
def test_same_set_same_groups_in_any_order(
    peers: set[str], round_: int, fragment: int, size: int, seed: int
) -> None:
    as_list = sorted(peers)
    shuffled = as_list[:]
    random.Random(seed).shuffle(shuffled)
    expected = form_groups(as_list, round_, fragment, size)
    assert form_groups(shuffled, round_, fragment, size) == expected
    assert form_groups(iter(shuffled), round_, fragment, size) == expected
    assert form_groups(frozenset(peers), round_, fragment, size) == expected


@given(peers=_peers, round_=_round, fragment=_fragment, size=_group_size)
def test_groups_are_balanced_and_cover_every_peer_once(
    peers: set[str], round_: int, fragment: int, size: int
) -> None:
    groups = form_groups(peers, round_, fragment, size)
    flat = [p for g in groups for p in g]
    assert sorted(flat) == sorted(peers)  # every peer exactly once
    sizes = [len(g) for g in groups]
    if size == 2 and len(peers) % 2 == 1 and len(peers) > 1:
        # pairs of an odd count: one triple rather than a peer averaging alone
        assert sorted(sizes) == [2] * (len(peers) // 2 - 1) + [3]
        return
    assert len(groups) == math.ceil(len(peers) / size)  # as few groups as the cap allows
    assert all(1 <= s <= size for s in sizes)
    if sizes:
        assert max(sizes) - min(sizes) <= 1


@given(peers=_peers, round_=_round, fragment=_fragment, size=_group_size)
def test_group_of_always_contains_me(
    peers: set[str], round_: int, fragment: int, size: int
) -> None:
    me = "the-caller"
    mine = group_of(me, peers, round_, fragment, size)
    assert me in mine
    assert len(mine) <= (3 if size == 2 else size)  # an odd count of pairs has one triple
    assert mine in form_groups(peers | {me}, round_, fragment, size)
    # Whether or not the caller listed itself, it gets the same group.
    assert group_of(me, peers | {me}, round_, fragment, size) == mine


def test_group_of_agrees_for_every_member() -> None:
    peers = _names(10)
    for group in form_groups(peers, 5, 2, 3):
        for me in group:
            assert group_of(me, peers, 5, 2, 3) == group


def test_groups_change_with_round_and_fragment() -> None:
    peers = _names(12)
    base = form_groups(peers, 0, 0, 3)
    by_round = [form_groups(peers, r, 0, 3) for r in range(1, 9)]
    by_fragment = [form_groups(peers, 0, f, 3) for f in range(1, 9)]
    # With 12 peers a collision is astronomically unlikely; one per family is enough to fail.
    assert all(g != base for g in by_round)
    assert all(g != base for g in by_fragment)
    # Round and fragment are separate fields, not concatenated digits: (1, 23) != (12, 3).
    assert form_groups(peers, 1, 23, 3) != form_groups(peers, 12, 3, 3)


def test_pairs_get_new_partners_over_rounds() -> None:
    peers = _names(8)
    partners: dict[str, set[str]] = {p: set() for p in peers}
    for r in range(20):
        for a, b in form_groups(peers, r, 0, 2):
            partners[a].add(b)
            partners[b].add(a)
    assert all(len(met) >= 3 for met in partners.values())


def test_a_peer_is_voted_out_by_a_strict_majority_of_announcers() -> None:
    from protocol.averaging.matchmaking import Announcement, voted_out

    def ann(peer: str, *excludes: str) -> Announcement:
        return Announcement(peer, 10, frozenset(excludes))

    bad = "peer-04"
    # three of five saw the evidence in time, one did not yet, the accused votes too
    seen = {p: ann(p, bad) for p in _names(3)} | {"peer-03": ann("peer-03"), bad: ann(bad)}
    assert voted_out(seen) == {bad}
    # two of five are not a majority: everyone keeps the peer in the round
    seen["peer-02"] = ann("peer-02")
    assert voted_out(seen) == set()
    # one node (an attacker) cannot vote honest peers out, nor can a peer vote for itself
    lone = {p: ann(p) for p in _names(4)} | {bad: ann(bad, *_names(4), bad)}
    assert voted_out(lone) == set()
    # half is not more than half
    assert (
        voted_out({"a": ann("a", "c"), "b": ann("b"), "c": ann("c"), "d": ann("d", "c")}) == set()
    )
