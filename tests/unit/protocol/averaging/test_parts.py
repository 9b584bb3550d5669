"""The pure parts of the all-reduce: part bounds, owners, the weighted mean, result bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocol.averaging.parts import (
    AllReduceResult,
    Contribution,
    PartPlan,
    part_bounds,
    weighted_mean_reducer,
)

# ---- part_bounds --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "parts", "align", "expected"),
    [
        (10, 1, 1, [(0, 10)]),
        (10, 2, 1, [(0, 5), (5, 10)]),
        (10, 3, 1, [(0, 4), (4, 7), (7, 10)]),
        (12, 3, 1, [(0, 4), (4, 8), (8, 12)]),
        # 4 blocks of 256 (the last one partial) over 3 parts: 2 + 1 + 1 blocks
        (1000, 3, 256, [(0, 512), (512, 768), (768, 1000)]),
        (1024, 4, 256, [(0, 256), (256, 512), (512, 768), (768, 1024)]),
        # one partial block: the first part takes it all, the rest are empty
        (100, 4, 256, [(0, 100), (100, 100), (100, 100), (100, 100)]),
        # fewer values than parts
        (2, 3, 1, [(0, 1), (1, 2), (2, 2)]),
        (0, 3, 1, [(0, 0), (0, 0), (0, 0)]),
        (0, 2, 256, [(0, 0), (0, 0)]),
        # 7 blocks of 4 over 3 parts: 3 + 2 + 2 blocks, the last one clamped to numel
        (26, 3, 4, [(0, 12), (12, 20), (20, 26)]),
    ],
)
def test_part_bounds_by_hand(
    numel: int, parts: int, align: int, expected: list[tuple[int, int]]
) -> None:
    assert part_bounds(numel, parts, align) == expected


@pytest.mark.parametrize("parts", [0, -3])
def test_part_bounds_needs_a_part(parts: int) -> None:
    with pytest.raises(ValueError, match="parts"):
        part_bounds(10, parts)


@given(
    numel=st.integers(min_value=0, max_value=100_000),
    parts=st.integers(min_value=1, max_value=64),
    align=st.integers(min_value=1, max_value=1024),
)
def test_part_bounds_tile_the_vector_on_block_edges(numel: int, parts: int, align: int) -> None:
    bounds = part_bounds(numel, parts, align)
    assert len(bounds) == parts
    assert bounds[0][0] == 0
    assert bounds[-1][1] == numel
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start  # contiguous: no gap, no overlap
    for start, end in bounds:
        assert 0 <= start <= end <= numel
        # every part starts on a codec block edge, so it is encoded with the same blocks
        # as the whole vector would be
        assert start % align == 0 or start == numel
    blocks = [-(-(end - start) // align) for start, end in bounds]
    assert max(blocks) - min(blocks) <= 1  # balanced to within one block
    assert blocks == sorted(blocks, reverse=True)  # the bigger parts come first


# ---- weighted_mean_reducer ----------------------------------------------------------


def _reduce(contributions):
    reduction = weighted_mean_reducer(1, 0, 0, contributions)
    return reduction.vector, reduction.used


def _c(peer: str, values: list[float], weight: float) -> Contribution:
    return Contribution(peer, torch.tensor(values, dtype=torch.float32), weight, b"")


def test_weighted_mean_by_hand() -> None:
    out, used = _reduce([_c("a", [1.0, 2.0, -4.0], 1), _c("b", [3.0, 4.0, 0.0], 3)])
    # (1*1 + 3*3) / 4, (1*2 + 3*4) / 4, (1*-4 + 3*0) / 4
    torch.testing.assert_close(out, torch.tensor([2.5, 3.5, -1.0]))
    assert used == ["a", "b"]


def test_weighted_mean_of_three() -> None:
    out, used = _reduce([_c("a", [6.0], 1), _c("b", [0.0], 2), _c("c", [12.0], 3)])
    torch.testing.assert_close(out, torch.tensor([(6.0 + 0.0 + 36.0) / 6]))
    assert used == ["a", "b", "c"]


def test_all_zero_weights_give_the_plain_mean() -> None:
    out, used = _reduce([_c("a", [1.0, 10.0], 0), _c("b", [2.0, 20.0], 0), _c("c", [6.0, 0.0], 0)])
    torch.testing.assert_close(out, torch.tensor([3.0, 10.0]))
    assert used == ["a", "b", "c"]


def test_negative_weights_count_as_zero() -> None:
    out, _ = _reduce([_c("a", [100.0], -5), _c("b", [2.0], 1)])
    torch.testing.assert_close(out, torch.tensor([2.0]))
    # all non-positive: the plain mean, not a division by a negative total
    out, _ = _reduce([_c("a", [1.0], -1), _c("b", [3.0], -2)])
    torch.testing.assert_close(out, torch.tensor([2.0]))


def test_single_contribution_is_itself() -> None:
    values = torch.randn(37, generator=torch.Generator().manual_seed(0))
    out, used = _reduce([Contribution("a", values, 7.0, b"")])
    torch.testing.assert_close(out, values)
    assert used == ["a"]


def test_empty_parts_reduce_to_empty() -> None:
    out, used = _reduce([_c("a", [], 1), _c("b", [], 2)])
    assert out.shape == (0,)
    assert used == ["a", "b"]


def test_reducer_does_not_modify_its_inputs() -> None:
    a, b = _c("a", [1.0, 2.0], 1), _c("b", [3.0, 4.0], 1)
    _reduce([a, b])
    assert a.vector.tolist() == [1.0, 2.0]
    assert b.vector.tolist() == [3.0, 4.0]


# ---- AllReduceResult ----------------------------------------------------------------


def _result(contributors: list[list[str]], fallback: list[int]) -> AllReduceResult:
    return AllReduceResult(
        vector=torch.zeros(3),
        group=["a", "b", "c"],
        contributors=contributors,
        fallback_parts=fallback,
    )


def test_complete_when_every_part_has_every_member() -> None:
    r = _result([["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"]], [])
    assert r.complete
    assert r.peers_in == {"a", "b", "c"}


def test_not_complete_with_a_fallback_part() -> None:
    r = _result([["a", "b", "c"], ["a"], ["a", "b", "c"]], [1])
    assert not r.complete


def test_not_complete_when_a_part_misses_a_member() -> None:
    r = _result([["a", "b", "c"], ["a", "b"], ["a", "b", "c"]], [])
    assert not r.complete
    assert r.peers_in == {"a", "b", "c"}


def test_not_complete_with_a_stranger_or_a_repeat() -> None:
    assert not _result([["a", "b", "c"], ["a", "b", "x"], ["a", "b", "c"]], []).complete
    assert not _result([["a", "b", "c"], ["a", "b", "b"], ["a", "b", "c"]], []).complete


def test_peers_in_counts_only_those_present() -> None:
    r = _result([["a", "b"], ["a"], ["a", "b"]], [1])
    assert r.peers_in == {"a", "b"}


# ---- who owns which part ---------------------------------------------------------------


def test_plan_without_clients_gives_every_member_a_part() -> None:
    plan = PartPlan.of("b", ["a", "b", "c"], None, 9, 1)
    assert plan.owners == ["a", "b", "c"] and plan.index == 1 and plan.is_owner
    assert plan.bounds == [(0, 3), (3, 6), (6, 9)]


def test_plan_of_a_client_sends_every_part_and_owns_none() -> None:
    plan = PartPlan.of("c", ["a", "c", "b"], ["a", "b"], 10, 1)
    assert plan.index == -1 and not plan.is_owner
    assert plan.bounds == [(0, 5), (5, 10)]
    owner = PartPlan.of("b", ["a", "c", "b"], ["a", "b"], 10, 1)
    assert owner.index == 1 and owner.bounds == plan.bounds  # everyone cuts the same parts


def test_a_gather_plan_gives_every_member_the_whole_vector_unless_there_is_a_client() -> None:
    plan = PartPlan.of("b", ["a", "b", "c"], None, 9, 4, gather=True)
    assert plan.gather and plan.index == 1 and plan.bounds == [(0, 9)] * 3
    # a client cannot be sent parts; a member alone has nobody to send to
    with_client = PartPlan.of("b", ["a", "b", "c"], ["a", "b"], 9, 1, gather=True)
    assert not with_client.gather and with_client.bounds == [(0, 5), (5, 9)]
    assert not PartPlan.of("a", ["a"], None, 9, 1, gather=True).gather


@pytest.mark.parametrize(
    ("me", "group", "owners"),
    [("z", ["a", "b"], None), ("a", ["a", "b"], []), ("a", ["a", "b"], ["a", "x"])],
)
def test_plan_refuses_inconsistent_groups(
    me: str, group: list[str], owners: list[str] | None
) -> None:
    with pytest.raises(ValueError):
        PartPlan.of(me, group, owners, 4, 1)
