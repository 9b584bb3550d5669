"""Butterfly mixing across groups: the grid, its axes, and the exact global mean; the cell
grid of large swarms."""

from __future__ import annotations

import pytest
import torch

from protocol.averaging.grouping import (
    Cell,
    butterfly_radices,
    cell_dims,
    cell_groups,
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
    # dyadic values: every partial mean is exact in float32, so equality is exact too;
    # powers of two: no mean of a part of the swarm equals the global mean by chance
    values = {
        p: torch.tensor([float(2**i), float(-3 * 2**i), 0.5 * 2**i]) for i, p in enumerate(peers)
    }
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


# ---- the cell grid of large swarms ---------------------------------------------------


@pytest.mark.parametrize(
    ("n", "size", "dims"),
    [(16, 4, 1), (31, 4, 1), (32, 4, 2), (300, 4, 3), (1024, 4, 4), (10_000, 4, 6), (8, 2, 2)],
)
def test_cell_dims_by_hand(n: int, size: int, dims: int) -> None:
    # the largest d with 2 G^d <= n: a line holds 2G to 2G^2 peers on average
    assert cell_dims(n, size) == dims


def test_a_cell_grid_needs_groups_of_two() -> None:
    with pytest.raises(ValueError, match="group_size"):
        cell_dims(100, 1)


def test_a_peer_keeps_its_point_while_the_axis_moves_through_a_cycle() -> None:
    cells = [Cell.of("peer-07", r, 3, 4, 1024) for r in range(4)]  # 1,024 peers: dims 4
    assert [c.axis for c in cells] == [0, 1, 2, 3] and {c.cycle for c in cells} == {0}
    assert cells[0] != cells[1]
    for c in cells:  # the digits off the axis are the peer's, whatever the round
        assert c.holds("peer-07") and c.coords[c.axis] is None
        others = [d for i, d in enumerate(cells[0].coords) if i != c.axis and i != 0]
        assert others == [d for i, d in enumerate(c.coords) if i != c.axis and i != 0]
    other = Cell.of("peer-07", 0, 4, 4, 1024)  # another fragment: the same line
    assert other.key == cells[0].key and other.coords == cells[0].coords


def test_every_cycle_of_dims_rounds_draws_a_new_grid() -> None:
    peers = _names(1024)
    first, again = Cell.of(peers[0], 0, 0, 4, 1024), Cell.of(peers[0], 4, 0, 4, 1024)
    assert (first.cycle, first.axis, again.cycle, again.axis) == (0, 0, 1, 0)
    mates = {p for p in peers if first.holds(p)}
    assert mates == {p for p in peers if Cell.of(peers[0], 0, 0, 4, 1024).holds(p)}
    # the same axis a cycle later: the line is mostly other peers
    later = {p for p in peers if again.holds(p)}
    assert peers[0] in mates & later and len(mates & later) < len(mates) / 2


def test_peers_share_a_line_exactly_when_their_keys_match() -> None:
    peers = _names(200)
    cells = {p: Cell.of(p, 5, 0, 4, 200) for p in peers}
    for p in peers[:20]:
        for q in peers:
            assert cells[p].holds(q) == (cells[p].key == cells[q].key)
    # 200 peers, d = 3: 16 lines of 12.5 on average
    assert len({c.key for c in cells.values()}) == 16


def test_cell_groups_partition_lines_into_groups_of_at_most_g() -> None:
    peers = _names(500)
    groups = cell_groups(peers, 2, 1, 4, 500)
    assert sorted(p for g in groups for p in g) == sorted(peers)
    for g in groups:
        cell = Cell.of(g[0], 2, 1, 4, 500)
        assert all(cell.holds(p) for p in g)  # a group never leaves its line
        assert 2 <= len(g) <= 4
    # the same groups whatever order the peers come in
    assert cell_groups(list(reversed(peers)), 2, 1, 4, 500) == groups


def test_a_line_alone_gives_its_peers_the_groups_the_whole_swarm_does() -> None:
    # what makes reading one line enough: a node that read only its line's
    # announcements computes its group as a node that read every announcement
    peers = _names(300)
    everyone = cell_groups(peers, 7, 0, 4, 300)
    for me in peers[:30]:
        cell = Cell.of(me, 7, 0, 4, 300)
        line = [p for p in peers if cell.holds(p)]
        (mine,) = [g for g in cell_groups(line, 7, 0, 4, 300) if me in g]
        assert mine in everyone


def test_clients_on_a_line_join_groups_with_an_owner() -> None:
    peers = _names(300)
    clients = set(peers[::3])
    for g in cell_groups(peers, 1, 0, 4, 300, clients=clients):
        assert owners(g, clients)


def test_cell_groups_bring_a_large_swarm_close_to_the_mean() -> None:
    # not exact as the butterfly is, but each round cuts the spread by about 1.95
    # (a random regrouping of the whole swarm, which needs every announcement: 2)
    peers = _names(1024)
    gen = torch.Generator().manual_seed(0)
    start = {p: torch.rand(1, generator=gen) for p in peers}
    mean = torch.stack(list(start.values())).mean()
    spread0 = float(torch.stack(list(start.values())).std())
    values = dict(start)
    for r in range(10):
        values = _mix(values, cell_groups(peers, r, 0, 4, 1024))
    stacked = torch.stack(list(values.values()))
    assert float(stacked.std()) < spread0 / 500  # 1.8 a round (a grid kept for good): 357
    torch.testing.assert_close(stacked.mean(), mean)  # equal weights keep the mean


@pytest.mark.parametrize("layout", ["random", "butterfly"])
def test_every_fragment_of_a_round_is_exchanged_in_the_same_groups(layout: str) -> None:
    """Who is with whom depends on the round, never the fragment (so a group's members
    hold the same values of every fragment before the round's steps); the fragment only
    moves which member owns which part."""
    peers = _names(16)
    clients = set(peers[:3])
    for r in range(4):
        by_fragment = [form_groups(peers, r, f, 4, layout, clients=clients) for f in range(4)]
        members = [sorted(sorted(g) for g in groups) for groups in by_fragment]
        assert all(m == members[0] for m in members), (layout, r)
        assert any(a != b for a, b in zip(by_fragment[0], by_fragment[1], strict=True))
    lines = [cell_groups(_names(300), 5, f, 4, 300) for f in range(3)]
    assert all(sorted(map(sorted, g)) == sorted(map(sorted, lines[0])) for g in lines)
