import pytest
import torch

from node.config import ModelConfig, TrainConfig
from node.data import BatchStream
from node.model import build_model
from node.trainer import InnerTrainer, evaluate, lr_at


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
