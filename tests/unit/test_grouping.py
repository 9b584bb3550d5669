"""Butterfly mixing across groups: the grid, its axes, and the exact global mean."""

from __future__ import annotations

import pytest
import torch

from protocol.averaging.grouping import (
    butterfly_radices,
    form_groups,
    group_of,
    owners,
    rounds_to_mix,
)


def _names(n: int) -> list[str]:
    return [f"peer-{i:02d}" for i in range(n)]


def _mix(values: dict[str, torch.Tensor], groups: list[list[str]]) -> dict[str, torch.Tensor]:
    """One round of group means (what an honest group all-reduce returns)."""
    out = {}
    for group in groups:
        mean = torch.stack([values[p] for p in group]).mean(0)
        out.update({p: mean.clone() for p in group})
    return out


@pytest.mark.parametrize(
    ("n", "size", "radices"),
    [(8, 2, [2, 2, 2]), (16, 4, [4, 4]), (12, 4, [4, 3]), (6, 4, [3, 2]), (9, 3, [3, 3])],
)
def test_radices_by_hand(n: int, size: int, radices: list[int]) -> None:
    assert butterfly_radices(n, size) == radices
    assert rounds_to_mix(n, size) == len(radices)


@pytest.mark.parametrize(("n", "size"), [(7, 2), (10, 4), (4, 4), (3, 8), (5, 1)])
def test_no_grid_when_one_group_or_a_large_prime(n: int, size: int) -> None:
    assert butterfly_radices(n, size) is None


def test_eight_nodes_in_pairs_reach_the_exact_global_mean_in_three_rounds() -> None:
    peers = _names(8)
    # dyadic values: every partial mean is exact in float32, so equality is exact too
    values = {p: torch.tensor([float(i), float(-3 * i), 0.5 * i]) for i, p in enumerate(peers)}
    target = torch.stack(list(values.values())).mean(0)
    seen = {p: {p} for p in peers}
    for r in range(3):
        groups = form_groups(peers, r, 0, 2, "butterfly")
        assert sorted(len(g) for g in groups) == [2] * 4
        for a, b in groups:
            seen[a], seen[b] = seen[a] | seen[b], seen[a] | seen[b]
        values = _mix(values, groups)
        if r < 2:
            assert not all(torch.equal(v, target) for v in values.values())
    for v in values.values():
        assert torch.equal(v, target)
    assert all(s == set(peers) for s in seen.values())  # everyone reached everyone


def test_random_pairs_do_not_reach_the_mean_in_three_rounds() -> None:
    # the reference the butterfly is better than: random regrouping mixes, not exactly
    peers = _names(8)
    values = {p: torch.tensor([float(i)]) for i, p in enumerate(peers)}
    target = torch.stack(list(values.values())).mean(0)
    for r in range(3):
        values = _mix(values, form_groups(peers, r, 0, 2, "random"))
    assert not all(torch.equal(v, target) for v in values.values())


def test_grid_of_mixed_radices_mixes_exactly() -> None:
    peers = _names(12)
    values = {p: torch.tensor([float(i * i)], dtype=torch.float64) for i, p in enumerate(peers)}
    target = torch.stack(list(values.values())).mean(0)
    for r in range(2):  # 12 = 4 x 3
        groups = form_groups(peers, r, 5, 4, "butterfly")
        assert sorted(len(g) for g in groups) == ([4] * 3 if r == 0 else [3] * 4)
        values = _mix(values, groups)
    for v in values.values():
        torch.testing.assert_close(v, target, rtol=0, atol=1e-12)


def test_butterfly_axis_cycles_and_members_agree() -> None:
    peers = _names(8)
    rounds = [form_groups(peers, r, 1, 2, "butterfly") for r in range(6)]
    # who is grouped with whom repeats every three rounds (member order may differ)
    lines = [sorted(sorted(g) for g in groups) for groups in rounds]
    assert lines[0:3] == lines[3:6]
    assert len({tuple(map(tuple, ls)) for ls in lines[0:3]}) == 3  # three distinct axes
    for groups in rounds:
        for group in groups:
            for me in group:
                assert group_of(me, peers, rounds.index(groups), 1, 2, "butterfly") == group


def test_butterfly_falls_back_to_random_regrouping() -> None:
    peers = _names(7)  # 7 is prime: no grid of pairs
    assert form_groups(peers, 4, 0, 2, "butterfly") == form_groups(peers, 4, 0, 2, "random")


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        form_groups(_names(4), 0, 0, 2, "ring")  # type: ignore[arg-type]


# ---- clients (peers nobody can dial) ---------------------------------------------------


def test_clients_join_groups_but_own_no_part() -> None:
    peers = _names(4)
    clients = {peers[3]}
    groups = form_groups(peers, 2, 0, 4, "butterfly", clients=clients)
    assert groups == form_groups(peers, 2, 0, 4, "butterfly")  # one group: nothing moves
    assert owners(groups[0], clients) == [p for p in groups[0] if p != peers[3]]


@pytest.mark.parametrize("layout", ["random", "butterfly"])
def test_a_group_of_only_clients_is_spread_over_groups_with_owners(layout: str) -> None:
    peers = _names(8)
    for r in range(6):
        plain = form_groups(peers, r, 3, 2, layout)
        # make one whole group clients: it cannot exchange on its own
        clients = set(plain[0])
        groups = form_groups(peers, r, 3, 2, layout, clients=clients)
        assert sorted(p for g in groups for p in g) == sorted(peers)  # nobody lost or doubled
        assert all(owners(g, clients) for g in groups)  # every group has an owner
        assert len(groups) == len(plain) - 1  # the clients' group dissolved into the others
        for group in groups:  # every member computes the same group
            for me in group:
                assert group_of(me, peers, r, 3, 2, layout, clients=clients) == group


def test_only_clients_keeps_the_groups_as_they_are() -> None:
    peers = _names(4)
    groups = form_groups(peers, 0, 0, 2, "random", clients=set(peers))
    assert groups == form_groups(peers, 0, 0, 2, "random")
    assert all(owners(g, set(peers)) == [] for g in groups)
