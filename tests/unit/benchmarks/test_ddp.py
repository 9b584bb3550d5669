"""The DDP baseline's plan: one kind of run at a time, with the fields that kind reads."""

from __future__ import annotations

import pytest

from benchmarks._ddp import DdpRun, run_ddp, run_timed_ddp

_OVERRIDES = ("model.context=16",)


@pytest.mark.parametrize(
    "kind",
    [{}, {"steps": 10, "seconds": 5.0}, {"steps": 0, "seconds": 0.0}],
    ids=["neither", "both", "both-zero"],
)
def test_a_plan_sets_exactly_one_of_steps_and_seconds(kind):
    with pytest.raises(ValueError, match="exactly one of steps and seconds"):
        DdpRun(_OVERRIDES, 2, **kind)


def test_a_plan_of_steps_or_of_seconds_is_taken_with_its_own_timeout():
    fixed = DdpRun(_OVERRIDES, 2, steps=10, eval_at=(0, 10))
    timed = DdpRun(_OVERRIDES, 2, seconds=5.0, slowdowns=(1.0, 2.0), evaluate=True)
    assert not fixed.timed and timed.timed
    assert (fixed.collective_timeout, timed.collective_timeout) == (300.0, 60.0)
    assert DdpRun(_OVERRIDES, 2, steps=1, gloo_timeout=600).collective_timeout == 600


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": 10, "evaluate": True}, "evaluate for one of seconds"),
        ({"seconds": 5.0, "eval_at": (0,)}, "eval_at is for a run of steps"),
        ({"seconds": 5.0, "slowdowns": (1.0, 2.0, 3.0)}, "3 slowdowns for 2 workers"),
    ],
)
def test_a_plan_refuses_fields_its_kind_would_ignore(fields, message):
    with pytest.raises(ValueError, match=message):
        DdpRun(_OVERRIDES, 2, **fields)


def test_each_front_end_refuses_the_other_kind_of_plan_before_starting_a_rank():
    with pytest.raises(ValueError, match="run_timed_ddp"):
        run_ddp(DdpRun(_OVERRIDES, 2, seconds=5.0), timeout=1.0)
    with pytest.raises(ValueError, match="run_ddp"):
        run_timed_ddp(DdpRun(_OVERRIDES, 2, steps=10))
