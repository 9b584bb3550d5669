"""Inner optimizers: AdamW, Muon (hidden matrices) with AdamW (the rest), SOAP; each
learns, and its state survives a checkpoint bitwise."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from node.config import ConfigError, ModelConfig, TrainConfig, load_config
from node.data.corpus import BatchStream
from node.train.model import build_model
from node.train.trainer import InnerTrainer, OptimizerSet, make_inner_optimizer

SMALL = ModelConfig(n_layer=1, n_embd=32, n_head=2, context=16)
DATA = torch.tensor(list(b"the inner optimizer learns this text. " * 40), dtype=torch.uint8)
OPTIMIZERS = ["adamw", "muon", "soap"]


def _trainer(optimizer: str, model: torch.nn.Module | None = None) -> InnerTrainer:
    cfg = TrainConfig(optimizer=optimizer, lr=3e-3, warmup_steps=2, total_steps=40)
    model = model if model is not None else build_model(SMALL, seed=0)
    return InnerTrainer(model, cfg, BatchStream(DATA, 4, 16, "k"))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_inner_optimizer_learns(optimizer: str) -> None:
    trainer = _trainer(optimizer)
    losses = [trainer.step().loss for _ in range(30)]
    # SOAP starts slower at the same lr (5.4 -> 4.3 here, AdamW and Muon 5.3 -> 2.8)
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    model = build_model(SMALL, seed=0)
    opt = make_inner_optimizer(model, TrainConfig(optimizer="muon"))
    assert isinstance(opt, OptimizerSet)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {
        n for n, p in model.named_parameters() if p.dim() == 2 and "blocks." in n
    }  # qkv, proj, fc, fc_out of each block
    assert {"tok.weight", "pos.weight", "head.weight"} <= in_adamw
    assert not in_muon & in_adamw
    assert len(in_muon | in_adamw) == len(list(model.parameters()))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_checkpointed_optimizer_continues_bitwise_as_if_never_stopped(optimizer: str) -> None:
    straight = _trainer(optimizer)
    for _ in range(10):
        straight.step()

    first = _trainer(optimizer)
    for _ in range(5):
        first.step()
    saved = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "inner": first.optimizer.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    model = build_model(SMALL, seed=1)  # other values: all of them come from the checkpoint
    model.load_state_dict(state["model"])
    resumed = _trainer(optimizer, model)
    resumed.optimizer.load_state_dict(state["inner"])
    resumed.steps = first.steps
    resumed.stream = copy.deepcopy(first.stream)
    for _ in range(5):
        resumed.step()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_the_state_of_another_optimizer_is_refused() -> None:
    muon = make_inner_optimizer(build_model(SMALL), TrainConfig(optimizer="muon"))
    adamw = make_inner_optimizer(build_model(SMALL), TrainConfig(optimizer="adamw"))
    with pytest.raises(ValueError, match="not this optimizer's"):
        muon.load_state_dict(adamw.state_dict())


def test_muon_and_soap_need_whole_matrices() -> None:
    with pytest.raises(ConfigError, match="needs whole weight matrices"):
        load_config(None, ["train.optimizer='muon'", "train.sharding='fsdp'"])
    assert load_config(None, ["train.optimizer='soap'"]).train.optimizer == "soap"


def test_a_checkpoint_of_another_optimizer_resumes_with_a_fresh_one(tmp_path, caplog) -> None:
    from threading import Event

    from node.run.metrics import EventLog
    from node.run.state import Progress, Running, Training
    from node.settings import round_settings
    from node.train.agreement import AgreementWatch
    from node.train.checkpoint import save_checkpoint
    from node.train.outer import OuterOptimizer
    from node.train.site_leader import NoSite
    from protocol.averaging.fragments import plan_fragments

    cfg = load_config(None, ["train.optimizer='muon'"])
    old = _trainer("adamw")
    old.step()
    plan = plan_fragments(old.model, 1)
    outer = OuterOptimizer(old.model, plan, cfg.outer)
    state = {
        "round": 3,
        "plan": plan.digest(),
        "model": old.model.state_dict(),
        "outer": outer.state_dict(),
        "inner": old.optimizer.state_dict(),  # AdamW's
        "steps": 1,
        "tokens": 64,
    }
    save_checkpoint(tmp_path / "checkpoints", 3, state)
    progress = Progress()
    training = Training(
        device=torch.device("cpu"),
        model=build_model(SMALL, seed=1),
        plan=plan,
        outer=outer,
        trainer=_trainer("muon"),
        feedback=[],
        val_batches=[],
        tokens=(torch.zeros(0), torch.zeros(0)),
        bytes_per_token=1.0,
        workload={},
        site=NoSite(),
    )
    running = Running(progress, training, None, None, EventLog(tmp_path / "events.jsonl"), Event())  # type: ignore[arg-type]
    rounds = round_settings(cfg, tmp_path).build(running, AgreementWatch())
    with caplog.at_level("WARNING"):
        rounds.resume()
    assert progress.round == 3 and "another inner optimizer" in caplog.text
    assert isinstance(training.trainer.optimizer, OptimizerSet)  # a fresh Muon + AdamW
    training.trainer.step()  # and it trains


def test_an_unknown_optimizer_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match="train.optimizer = 'lion': expected one of adamw"):
        load_config(None, ["train.optimizer='lion'"])
