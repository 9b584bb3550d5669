"""Fault injection for tests and benchmarks: each mode corrupts what a node sends in its
one way, and an honest node's behaviour is untouched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.config import ModelConfig, TrainConfig
from node.data.corpus import BatchStream
from node.swarm.byzantine import (
    ALL_MODES,
    QUIET_MODES,
    make_behaviour,
    trainer_class,
    training_data,
)
from node.swarm.fault_modes import parse_mode
from node.train.model import build_model
from node.train.trainer import InnerTrainer
from protocol.averaging.hooks import FaultInjection
from protocol.averaging.sealing import seal_for, seal_with
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import open_part
from verification.identity import Identity, verify

ME = Identity.from_seed(b"z" * 32)
VECTOR = torch.tensor([1.0, -2.0, 3.0, -4.0])


def _request(mode: str, round_: int = 1):
    behaviour = make_behaviour(mode)
    header = Header("part", "run", round_, 0, 0, ME.peer_id)
    meta = {"content": "update", "weight": 5}
    return seal_with(behaviour, ME, header, meta, codecs.encode(VECTOR, "none"))


def test_honest_is_the_default_and_an_unknown_mode_is_named() -> None:
    assert type(make_behaviour(None)) is FaultInjection
    assert type(make_behaviour("honest")) is FaultInjection
    with pytest.raises(ValueError, match="expected one of sign_flip"):
        make_behaviour("polite")


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("sign_flip", [-1.0, 2.0, -3.0, 4.0]),
        ("scale", [50.0, -100.0, 150.0, -200.0]),
        ("zero", [0.0, 0.0, 0.0, 0.0]),
        ("alie", [0.0, -4.0, 0.0, -8.0]),
        ("ipm", [-0.5, 1.0, -1.5, 2.0]),
    ],
)
def test_vector_attacks_by_hand(mode: str, expected: list[float]) -> None:
    out = make_behaviour(mode).contribution(1, 0, VECTOR)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_noise_is_large_next_to_the_update_and_seeded() -> None:
    a = make_behaviour("noise", seed=1).contribution(1, 0, VECTOR)
    b = make_behaviour("noise", seed=1).contribution(1, 0, VECTOR)
    assert torch.equal(a, b) and (a - VECTOR).norm() > 3 * VECTOR.norm()


def test_wire_attacks_break_the_rule_a_receiver_checks() -> None:
    honest = _request("honest")
    forged = _request("bad_signature")
    assert not verify(ME.peer_id, b"atoll/part/v1\0" + forged.digest, forged.signature)
    inflated = open_part(_request("inflated_tokens").to_bytes(), max_bytes=1 << 20)
    assert inflated.meta["weight"] == 10**12
    longer = open_part(_request("wrong_shape").to_bytes(), max_bytes=1 << 20)
    assert longer.body.nbytes == honest.body.nbytes + 4
    nan = open_part(_request("nan").to_bytes(), max_bytes=1 << 20)
    assert torch.frombuffer(bytearray(nan.body), dtype=torch.float32)[0].isnan()


def test_a_replay_resends_the_first_part_in_every_later_round() -> None:
    behaviour = make_behaviour("replay")
    header = Header("part", "run", 1, 0, 0, ME.peer_id)
    first = seal_with(behaviour, ME, header, {"content": "update"}, codecs.encode(VECTOR, "none"))
    header5 = Header("part", "run", 5, 0, 0, ME.peer_id)
    twice = codecs.encode(2 * VECTOR, "none")
    later = seal_with(behaviour, ME, header5, {"content": "update"}, twice)
    assert later is first


class _Commitments:
    def __init__(self) -> None:
        self.made: list[tuple[tuple, dict]] = []

    async def commit(self, round_, fragment, group, digests, content="update") -> None:
        self.made.append((tuple(group), dict(digests)))


def _commit(mode: str, commitments: _Commitments, group: list[str], digests: dict) -> None:
    """Commit as a member does (``_commit_phase``), with ``mode``'s changes."""
    behaviour = make_behaviour(mode)
    for waited, made in behaviour.commits(group, digests):
        asyncio.run(commitments.commit(1, 0, waited, made))


def test_commit_attacks_skip_or_equivocate() -> None:
    digests = {0: b"d" * 32}
    skipped, twice, late = _Commitments(), _Commitments(), _Commitments()
    _commit("skip_commit", skipped, ["a"], digests)
    _commit("equivocate", twice, ["a"], digests)
    _commit("late_commit", late, ["a"], digests)
    assert skipped.made == []
    (first_group, first), (second_group, second) = twice.made
    assert first != second and second == digests and second_group == ("a",)
    assert late.made == [((), digests)] and make_behaviour("late_commit").commit_delay > 2
    assert make_behaviour(None).commits(["a"], digests) == [(["a"], digests)]


def test_a_split_sends_its_first_other_member_another_part_than_the_rest() -> None:
    behaviour = make_behaviour("split")
    header = Header("part", "run", 1, 0, 2, ME.peer_id)  # the member's own index: 2
    meta = {"content": "update", "weight": 5, "exchange": "gather"}
    enc = codecs.encode(VECTOR, "none")
    part = seal_with(behaviour, ME, header, meta, enc)
    assert seal_for(behaviour, ME, 1, part, header, meta, enc) is part
    assert seal_for(behaviour, ME, 3, part, header, meta, enc) is part
    other = seal_for(behaviour, ME, 0, part, header, meta, enc)
    opened = open_part(other.to_bytes(), max_bytes=1 << 20)
    assert other.digest != part.digest and opened.meta["weight"] == 6
    assert bytes(opened.body) == bytes(part.body)  # the same values, signed anew
    assert seal_for(FaultInjection(), ME, 0, part, header, meta, enc) is part


def test_owner_attacks_forge_inputs_or_wreck_the_result() -> None:
    meta = make_behaviour("bad_owner").reduced_meta({"digests": [b"a" * 32]})
    assert meta["digests"] != [b"a" * 32]
    wrecked = make_behaviour("malicious_owner").reduced(torch.ones(2))
    assert wrecked.tolist() == [-11.0, -11.0]
    assert make_behaviour("silent").silent_in(3, 1)


def test_a_silent_share_goes_quiet_in_that_share_of_exchanges_drawn_by_seed() -> None:
    flaky = make_behaviour("silent=0.3", seed=5)
    quiet = [(r, f) for r in range(1, 201) for f in range(2) if flaky.silent_in(r, f)]
    assert 0.2 < len(quiet) / 400 < 0.4
    again = make_behaviour("silent=0.3", seed=5)
    assert quiet == [(r, f) for r in range(1, 201) for f in range(2) if again.silent_in(r, f)]
    other = make_behaviour("silent=0.3", seed=6)
    assert quiet != [(r, f) for r in range(1, 201) for f in range(2) if other.silent_in(r, f)]
    assert not make_behaviour(None).silent_in(1, 0)
    with pytest.raises(ValueError, match="exchanges it is silent in"):
        make_behaviour("silent=2")


def test_random_data_replaces_the_bytes_a_node_trains_on() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    assert training_data(None, data) is data
    noise = training_data("random_data", data, seed=3)
    assert noise.shape == data.shape and not torch.equal(noise, data)
    assert torch.equal(noise, training_data("random_data", data, seed=3))


# ---- quiet modes: poisoned data, lazy steps, copied updates ----------------------------


def test_the_quiet_modes_are_known_by_name() -> None:
    for mode in ("poison", "lazy", "copy"):
        assert mode in QUIET_MODES and mode in ALL_MODES
    assert type(make_behaviour("poison")) is FaultInjection
    assert type(make_behaviour("lazy")) is FaultInjection
    assert trainer_class(None) is InnerTrainer and trainer_class("poison") is InnerTrainer
    assert trainer_class("lazy") is not InnerTrainer


def test_poison_trains_on_the_tokens_in_reverse_order() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    poisoned = training_data("poison", data, seed=3)
    assert poisoned.tolist() == list(range(99, -1, -1))
    assert data.tolist() == list(range(100))  # the tokens themselves are left alone


class _Counted(BatchStream):
    """A stream that counts the batches drawn from it."""

    def __init__(self, data: torch.Tensor, batch_size: int, context: int) -> None:
        super().__init__(data, batch_size, context, "k")
        self.drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return super().next()


def _lazy(mode: str = "lazy") -> InnerTrainer:
    text = torch.tensor(
        list(b"the quick brown fox jumps over the lazy dog. " * 20), dtype=torch.uint8
    )
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, context=8), seed=0)
    cfg = TrainConfig(optimizer="sgd", lr=1e-1, warmup_steps=0, grad_accum=2)
    return trainer_class(mode)(model, cfg, _Counted(text, 4, 8))


def test_lazy_steps_once_in_ten_calls_and_counts_every_call() -> None:
    trainer = _lazy()
    real, stepped = trainer.optimizer.step, []

    def counted_step(*args, **kwargs):
        stepped.append(trainer.steps)  # the step count before this optimizer step
        return real(*args, **kwargs)

    trainer.optimizer.step = counted_step
    changed, losses = [], []
    for call in range(1, 22):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        result = trainer.step()
        after = list(trainer.model.parameters())
        if any(not torch.equal(b, a) for b, a in zip(before, after)):
            changed.append(call)
        losses.append(result.loss)
        assert result.tokens == 2 * 4 * 8 and trainer.tokens == call * 2 * 4 * 8
        assert trainer.steps == call
    assert changed == [1, 11, 21] and stepped == [0, 10, 20]
    assert trainer.stream.drawn == 3 * 2  # a skipped step draws no batch
    assert losses[1:10] == [losses[0]] * 9 and losses[11:20] == [losses[10]] * 9


@pytest.mark.parametrize(
    ("mode", "real"),
    [("lazy=0.5", [1, 3, 5, 7, 9]), ("lazy=0.25", [1, 5, 9]), ("lazy=1", list(range(1, 11)))],
)
def test_a_lazy_share_runs_that_share_of_its_steps(mode: str, real: list[int]) -> None:
    trainer = _lazy(mode)
    changed = []
    for call in range(1, 11):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.step()
        if any(not torch.equal(b, a) for b, a in zip(before, trainer.model.parameters())):
            changed.append(call)
    assert changed == real and trainer.steps == 10
    assert trainer.stream.drawn == 2 * len(real)


@pytest.mark.parametrize("mode", ["lazy=0", "lazy=2", "lazy=half", "zero=0.5", "lazy_x"])
def test_bad_mode_parameters_are_refused_by_name(mode: str) -> None:
    with pytest.raises(ValueError, match="--byzantine"):
        parse_mode(mode)


def test_lazy_refuses_a_site_whose_ranks_train_in_step() -> None:
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, context=8), seed=0)
    stream = BatchStream(torch.zeros(100, dtype=torch.uint8), 2, 8, "k")
    with pytest.raises(ValueError, match="lazy"):
        trainer_class("lazy")(model, TrainConfig(), stream, ranks=2)


def test_copy_sends_the_last_global_change_and_zeros_first() -> None:
    globals_ = {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([5.0, 5.0])}
    behaviour = make_behaviour("copy", global_vector=lambda f: globals_[f].clone())
    own = torch.tensor([9.0, 9.0, 9.0])
    first = behaviour.contribution(1, 0, own)
    assert first.tolist() == [0.0, 0.0, 0.0] and first.dtype == own.dtype
    assert behaviour.contribution(1, 1, torch.ones(2)).tolist() == [0.0, 0.0]
    globals_[0] = torch.tensor([0.5, 2.5, 1.0])
    second = behaviour.contribution(2, 0, own)
    torch.testing.assert_close(second, torch.tensor([0.5, -0.5, 2.0]))
    weights = torch.tensor([7.0, 7.0, 7.0])
    assert behaviour.contribution(2, 0, weights) is weights  # the round's global copies
    globals_[0] = torch.tensor([0.0, 0.0, 0.0])
    third = behaviour.contribution(4, 0, own)  # round 3 skipped: since the last sync
    torch.testing.assert_close(third, torch.tensor([0.5, 2.5, 1.0]))


def test_copy_matches_the_contribution_dtype_and_needs_the_global_copies() -> None:
    globals_ = [torch.tensor([1.0, 1.0])]
    behaviour = make_behaviour("copy", global_vector=lambda f: globals_[f].clone())
    behaviour.contribution(1, 0, torch.zeros(2, dtype=torch.float16))
    globals_[0] = torch.tensor([0.25, 3.0])
    out = behaviour.contribution(2, 0, torch.zeros(2, dtype=torch.float16))
    assert out.dtype == torch.float16 and out.tolist() == [0.75, -2.0]
    with pytest.raises(AssertionError, match="copy"):
        make_behaviour("copy").contribution(1, 0, torch.zeros(2))
