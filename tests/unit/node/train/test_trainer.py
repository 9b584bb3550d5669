import dataclasses

import pytest
import torch

from node.config import ModelConfig, TrainConfig
from node.data.corpus import BatchStream
from node.train.model import build_model
from node.train.trainer import InnerTrainer, evaluate, lr_at


def test_lr_schedule_hand_values():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.25)
    assert lr_at(3, cfg) == pytest.approx(1.0)
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_at(14, cfg) == pytest.approx(0.1)
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_inner_steps_fit_repeated_text():
    data = torch.tensor(list(b"abcdefgh" * 200), dtype=torch.uint8)
    model = build_model(ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16), seed=0)
    stream = BatchStream(data, 8, 16, "k")
    batches = stream.fixed_batches(2)
    before = evaluate(model, batches)
    trainer = InnerTrainer(model, TrainConfig(lr=1e-2, warmup_steps=2, total_steps=60), stream)
    for _ in range(60):
        result = trainer.step()
    assert trainer.steps == 60 and trainer.tokens == 60 * 8 * 16
    assert result.tokens == 128
    after = evaluate(model, batches)
    assert before > 7.0 and after < 1.0


# ---- grad_accum, activation checkpointing, compile ----------------------------------------

_TEXT = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 60), dtype=torch.uint8)
_SMALL = ModelConfig(n_layer=2, n_embd=32, n_head=2, context=16)
_HF = {
    "arch": "hf",
    "preset": "llama-tiny",
    "vocab_size": 256,
    "context": 16,
}


class _Joined:
    """A stream whose batch is two of another stream's, side by side."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream

    def next(self):
        (a, ta), (b, tb) = self.stream.next(), self.stream.next()
        return torch.cat([a, b]), torch.cat([ta, tb])


def test_grad_accum_steps_as_one_batch_of_all_the_micro_batches() -> None:
    # SGD: a step is linear in the gradient, so only summation order can tell them apart
    cfg = TrainConfig(optimizer="sgd", lr=1e-1, warmup_steps=0, grad_clip=0.0)
    accum = build_model(_SMALL, seed=0)
    whole = build_model(_SMALL, seed=0)
    a = InnerTrainer(accum, dataclasses.replace(cfg, grad_accum=2), BatchStream(_TEXT, 4, 16, "k"))
    b = InnerTrainer(whole, cfg, _Joined(BatchStream(_TEXT, 4, 16, "k")))
    for _ in range(3):
        ra, rb = a.step(), b.step()
        assert ra.tokens == rb.tokens == 8 * 16
        assert ra.loss == pytest.approx(rb.loss, rel=1e-5)
    for pa, pb in zip(accum.parameters(), whole.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert a.tokens == 3 * 8 * 16


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_activation_checkpointing_gives_the_same_steps(kind: str) -> None:
    cfg = ModelConfig(**_HF) if kind == "hf" else _SMALL
    plain, recomputed = build_model(cfg, seed=0), build_model(cfg, seed=0)
    train = TrainConfig(lr=1e-2, warmup_steps=0)
    a = InnerTrainer(plain, train, BatchStream(_TEXT, 4, 16, "k"))
    b = InnerTrainer(
        recomputed,
        dataclasses.replace(train, activation_checkpointing=True),
        BatchStream(_TEXT, 4, 16, "k"),
    )
    for _ in range(2):
        assert a.step().loss == pytest.approx(b.step().loss, rel=1e-6)
    for pa, pb in zip(plain.parameters(), recomputed.parameters()):
        torch.testing.assert_close(pa, pb)
    if kind == "hf":
        assert recomputed.lm.is_activation_checkpointing
    else:
        assert recomputed.checkpointing and not plain.checkpointing


def test_activation_checkpointing_needs_a_model_that_offers_it() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    with pytest.raises(
        ValueError, match="train.activation_checkpointing: Sequential does not offer it"
    ):
        InnerTrainer(
            model, TrainConfig(activation_checkpointing=True), BatchStream(_TEXT, 2, 8, "k")
        )


@pytest.mark.slow
def test_a_compiled_model_trains_as_the_eager_one() -> None:
    eager, compiled = build_model(_SMALL, seed=0), build_model(_SMALL, seed=0)
    train = TrainConfig(lr=1e-2, warmup_steps=0)
    a = InnerTrainer(eager, train, BatchStream(_TEXT, 4, 16, "k"))
    b = InnerTrainer(
        compiled, dataclasses.replace(train, compile=True), BatchStream(_TEXT, 4, 16, "k")
    )
    for _ in range(3):
        assert a.step().loss == pytest.approx(b.step().loss, rel=1e-4)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
