"""Devices and precision: bf16 autocast for the inner step with float32 master weights;
``run.device`` names (``cuda:N`` checked against the devices present)."""

from __future__ import annotations

import pytest
import torch

from node.config import ConfigError, ModelConfig, TrainConfig, load_config
from node.data.corpus import BatchStream
from node.ops.simulate import resolve_device
from node.train.model import build_model
from node.train.outer import OuterOptimizer
from node.train.trainer import InnerTrainer
from protocol.averaging.fragments import plan_fragments

SMALL = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16)


def _trainer(precision: str) -> tuple[InnerTrainer, list[torch.dtype]]:
    data = torch.tensor(list(b"bf16 under autocast, fp32 master weights. " * 30), dtype=torch.uint8)
    model = build_model(SMALL, seed=0)
    seen: list[torch.dtype] = []
    model.blocks[0].fc.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    cfg = TrainConfig(lr=1e-2, warmup_steps=1, total_steps=20, precision=precision)
    return InnerTrainer(model, cfg, BatchStream(data, 4, 16, "k")), seen


@pytest.mark.parametrize(
    "precision, activations", [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_activations_follow_the_precision_and_weights_stay_float32(precision, activations) -> None:
    trainer, seen = _trainer(precision)
    first = trainer.step()
    for _ in range(9):
        last = trainer.step()
    assert seen and set(seen) == {activations}
    for p in trainer.model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32
    assert last.loss < first.loss  # it still learns


def test_the_outer_step_is_float32_after_bf16_inner_steps() -> None:
    trainer, _ = _trainer("bf16")
    plan = plan_fragments(trainer.model, 1)
    outer = OuterOptimizer(trainer.model, plan, load_config(None, []).outer)
    before = outer.global_vector(0).clone()
    for _ in range(5):
        trainer.step()
    pseudo = outer.pseudo_gradient(trainer.model, 0)
    assert pseudo.dtype == torch.float32 and pseudo.abs().sum() > 0
    outer.step(0, pseudo)
    after = outer.global_vector(0)
    assert after.dtype == torch.float32 and not torch.equal(after, before)


def test_device_names() -> None:
    assert load_config(None, ['run.device="cuda:3"']).run.device == "cuda:3"
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:0"):
        with pytest.raises(ConfigError, match="expected auto, cpu, cuda or cuda:N"):
            load_config(None, [f"run.device={bad!r}".replace("'", '"')])
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_cuda_device_that_is_not_there_is_a_clear_error(monkeypatch) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is available"):
            resolve_device("cuda:0")
    # a machine with two GPUs (the only stand-in here: no GPU on this machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"has 2 CUDA device\(s\): cuda:0 to cuda:1"):
        resolve_device("cuda:2")
