import pytest
import torch
from torch import nn

from node.config import OuterConfig
from node.train.outer import OuterOptimizer, make_outer_optimizer, sync_schedule
from protocol.averaging.fragments import plan_fragments


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))


def test_nesterov_matches_hand_computation():
    model = Toy()
    plan = plan_fragments(model, 1)
    outer = OuterOptimizer(model, plan, OuterConfig(momentum=0.9))  # DiLoCo's, hand-computed below
    with torch.no_grad():
        model.w.copy_(torch.tensor([0.5, 2.5]))
    pg = outer.pseudo_gradient(model, 0)
    torch.testing.assert_close(pg, torch.tensor([0.5, -0.5]))
    # Step 1: buf = g; update = g + 0.9 * buf = 1.9 g; w = w0 - 0.7 * update.
    outer.apply(model, 0, pg)
    torch.testing.assert_close(model.w.detach(), torch.tensor([0.335, 2.665]))
    # Step 2 with g2 = [0.1, 0.2]: buf = 0.9*[0.5,-0.5] + g2 = [0.55, -0.25];
    # update = g2 + 0.9*buf = [0.595, -0.025]; w = [0.335 - 0.4165, 2.665 + 0.0175].
    outer.apply(model, 0, torch.tensor([0.1, 0.2]))
    torch.testing.assert_close(model.w.detach(), torch.tensor([-0.0815, 2.6825]))
    torch.testing.assert_close(outer.global_vector(0), model.w.detach())


def test_lr1_plain_sgd_is_plain_averaging():
    model = Toy()
    outer = OuterOptimizer(
        model, plan_fragments(model, 1), OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
    )
    with torch.no_grad():
        model.w.copy_(torch.tensor([3.0, 4.0]))
    outer.apply(model, 0, outer.pseudo_gradient(model, 0))
    torch.testing.assert_close(model.w.detach(), torch.tensor([3.0, 4.0]))


def test_other_optimizers_and_errors():
    p = [nn.Parameter(torch.zeros(2))]
    assert isinstance(
        make_outer_optimizer(p, OuterConfig(optimizer="Adam", lr=0.1)), torch.optim.Adam
    )
    assert isinstance(
        make_outer_optimizer(p, OuterConfig(optimizer="torch.optim.SGD", lr=0.1)), torch.optim.SGD
    )
    with pytest.raises(ValueError, match="outer.optimizer"):
        make_outer_optimizer(p, OuterConfig(optimizer="nope"))
    with pytest.raises(ValueError, match="outer.kwargs"):
        make_outer_optimizer(p, OuterConfig(optimizer="Adam", kwargs={"bogus": 1}))
    model = Toy()
    outer = OuterOptimizer(model, plan_fragments(model, 1), OuterConfig())
    with pytest.raises(ValueError, match="shape"):
        outer.step(0, torch.zeros(3))
    with pytest.raises(ValueError, match="not finite"):
        outer.step(0, torch.tensor([float("nan"), 0.0]))


def test_state_dict_round_trip():
    model = Toy()
    plan = plan_fragments(model, 1)
    a = OuterOptimizer(model, plan, OuterConfig())
    a.step(0, torch.tensor([0.5, -0.5]))
    b = OuterOptimizer(Toy(), plan, OuterConfig())
    b.load_state_dict(a.state_dict())
    a.step(0, torch.tensor([0.1, 0.2]))
    b.step(0, torch.tensor([0.1, 0.2]))
    torch.testing.assert_close(a.global_vector(0), b.global_vector(0))


def test_sync_schedule_staggers_every_fragment_once():
    assert sync_schedule(50, 1) == {50: [0]}
    assert sync_schedule(8, 4) == {2: [0], 4: [1], 6: [2], 8: [3]}
    sched = sync_schedule(5, 3)
    assert sorted(f for fs in sched.values() for f in fs) == [0, 1, 2]
    assert max(sched) == 5
    with pytest.raises(ValueError):
        sync_schedule(0, 1)


def test_outer_schedule_hand_values():
    model = Toy()
    plan = plan_fragments(model, 1)
    warm = OuterOptimizer(model, plan, OuterConfig(momentum=0.9, momentum_warmup=3))
    assert [round(warm.schedule(r)[1], 6) for r in (1, 2, 3, 4, 10)] == [0.3, 0.6, 0.9, 0.9, 0.9]
    assert warm.schedule(5)[0] == 0.7  # constant lr
    cosine = OuterOptimizer(
        model, plan, OuterConfig(lr=1.0, lr_schedule="cosine", lr_rounds=4, min_lr_ratio=0.2)
    )
    # progress (r - 1) / 4: 0, 0.5, 1, then held: lr = 0.2 + 0.8 * (1 + cos(pi p)) / 2
    lrs = [round(cosine.schedule(r)[0], 6) for r in (1, 3, 5, 9)]
    assert lrs == [1.0, 0.6, 0.2, 0.2]
    adam = OuterOptimizer(model, plan, OuterConfig(optimizer="Adam", lr=0.1))
    assert adam.schedule(1) == (0.1, None)  # no momentum to warm up


def test_a_warmed_up_first_step_matches_hand_computation():
    model = Toy()
    plan = plan_fragments(model, 1)
    outer = OuterOptimizer(model, plan, OuterConfig(momentum=0.9, momentum_warmup=3))
    # round 1: momentum 0.3: buf = g; update = g + 0.3 g = 1.3 g; w = w0 - 0.7 * 1.3 g
    outer.apply(model, 0, torch.tensor([0.5, -0.5]), 1)
    torch.testing.assert_close(model.w.detach(), torch.tensor([1.0 - 0.455, 2.0 + 0.455]))
    # without a round the optimizer steps as configured (momentum 0.9: 1.9 g)
    plain = OuterOptimizer(Toy(), plan_fragments(Toy(), 1), OuterConfig(momentum=0.9))
    moved = plain.step(0, torch.tensor([0.5, -0.5]))
    torch.testing.assert_close(moved, torch.tensor([1.0 - 0.665, 2.0 + 0.665]))


def test_outer_schedule_settings_are_checked():
    from pydantic import ValidationError

    with pytest.raises((ValueError, ValidationError), match="needs outer.lr_rounds"):
        OuterConfig(lr_schedule="cosine")
    with pytest.raises((ValueError, ValidationError), match="nesterov and sgd only"):
        OuterConfig(optimizer="Adam", momentum_warmup=2)


class _PinLedger:
    """Stands in for CUDA's page-locked memory (there is no GPU here): records which
    storages were pinned."""

    def __init__(self, monkeypatch) -> None:
        self.storages: set[int] = set()
        ledger = self

        def pin_memory(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().clone()
            ledger.storages.add(out.untyped_storage().data_ptr())
            return out

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(
            torch.Tensor,
            "is_pinned",
            lambda t: t.untyped_storage().data_ptr() in ledger.storages,
        )

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages


def test_beside_a_gpu_the_outer_state_stays_in_pinned_host_memory(monkeypatch) -> None:
    from protocol.wire.feedback import FeedbackSettings

    ledger = _PinLedger(monkeypatch)
    model, same = Toy(), Toy()
    plan = plan_fragments(model, 1)
    pinned = OuterOptimizer(model, plan, OuterConfig(momentum=0.9), pin=True)
    plain = OuterOptimizer(same, plan, OuterConfig(momentum=0.9))
    g = pinned.globals[0]
    assert ledger.holds(g) and g.dtype == torch.float32 and g.device.type == "cpu"
    buffer = pinned.optimizers[0].state[g]["momentum_buffer"]
    assert ledger.holds(buffer)
    for step in (torch.tensor([0.5, -0.5]), torch.tensor([0.1, 0.2])):
        pinned.apply(model, 0, step)
        plain.apply(same, 0, step)
    # the same numbers as state torch makes itself, in the same (pinned) buffer
    assert torch.equal(pinned.globals[0].detach(), plain.globals[0].detach())
    assert pinned.optimizers[0].state[g]["momentum_buffer"] is buffer
    fresh = OuterOptimizer(Toy(), plan, OuterConfig(momentum=0.9), pin=True)
    fresh.load_state_dict(plain.state_dict())  # a checkpoint read back is pinned again
    assert ledger.holds(fresh.optimizers[0].state[fresh.globals[0]]["momentum_buffer"])
    assert torch.equal(fresh.globals[0].detach(), plain.globals[0].detach())
    feedback = FeedbackSettings("int8", pin_memory=True).build()
    feedback.encode(torch.randn(1000))
    assert ledger.holds(feedback.residual)
    assert not ledger.holds(plain.globals[0])


def test_a_snapshot_without_momentum_clears_the_takers_own():
    """A node that takes the state of a peer that never stepped a fragment steps it next
    exactly as that peer does (its own momentum from before would set it apart)."""

    def stepped(steps: int) -> OuterOptimizer:
        model = Toy()
        outer = OuterOptimizer(model, plan_fragments(model, 1), OuterConfig(momentum=0.9))
        for _ in range(steps):
            outer.step(0, torch.tensor([0.3, -0.1]))
        return outer

    fresh, used = stepped(0), stepped(2)
    used.load_snapshot(fresh.snapshot(3, "plan"))
    a, b = fresh.step(0, torch.tensor([0.1, 0.2])), used.step(0, torch.tensor([0.1, 0.2]))
    assert torch.equal(a, b)
