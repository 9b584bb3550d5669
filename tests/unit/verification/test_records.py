"""The plain records the verifier judges: frozen, with the defaults they promise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verification.records import Contribution, Prefix, Reduction, StreamPlan


def test_a_contribution_is_frozen_and_its_claims_default_to_unknown() -> None:
    c = Contribution("peer", torch.ones(3), 2.0, b"d" * 32)
    assert c.tokens == 0 and c.norm is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.weight = 3.0  # type: ignore[misc]


def test_each_reduction_has_its_own_rejections() -> None:
    a = Reduction(torch.zeros(2), ["x"])
    b = Reduction(torch.zeros(2), ["y"])
    a.rejected["z"] = "norm"
    assert b.rejected == {} and a.rejected == {"z": "norm"}


def test_a_prefix_holds_the_plan_it_was_reduced_with() -> None:
    plan = StreamPlan(("a", "b"), (1.0, 3.0), lambda rows: (rows[0] + 3 * rows[1]) / 4)
    out = torch.empty(4)
    out[:2] = plan.combine([torch.tensor([4.0, 8.0]), torch.tensor([0.0, 4.0])])
    prefix = Prefix(plan, out, 2)
    assert prefix.plan.peers == ("a", "b") and prefix.upto == 2
    torch.testing.assert_close(prefix.out[:2], torch.tensor([1.0, 5.0]))
