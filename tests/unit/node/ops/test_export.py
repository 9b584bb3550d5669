"""`atoll export`: the agreed global parameters of a checkpoint, as safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from node.cli import main
from node.config import ModelConfig, OuterConfig
from node.ops.export import FORMAT, export_model, parameters_digest
from node.train.checkpoint import save_checkpoint
from node.train.model import build_model
from node.train.outer import OuterOptimizer
from protocol.averaging.fragments import plan_fragments

CFG = ModelConfig(n_layer=1, n_embd=16, n_head=2, context=16)


def _checkpoint(data_dir: Path, round_: int, shift: float, *, layout: bool = True) -> dict:
    """A checkpoint as a node writes it, whose global copies differ from its local model."""
    model = build_model(CFG, seed=1)
    plan = plan_fragments(model, 2)
    outer = OuterOptimizer(model, plan, OuterConfig())
    for f in range(len(plan)):  # the agreed values moved on; the local copy did too, apart
        outer.set_global(f, outer.global_vector(f) + shift * (f + 1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    state = {
        "round": round_,
        "run_id": "run-x",
        "global_digest": "ab" * 32,
        "plan": plan.digest(),
        "model": model.state_dict(),
        "outer": outer.state_dict(),
        "inner": {},
        "steps": 7,
        "tokens": 70,
    }
    if layout:
        state["layout"] = [[list(f.names), [list(s) for s in f.shapes]] for f in plan.fragments]
    save_checkpoint(data_dir / "checkpoints", round_, state, keep=5)
    return {"plan": plan, "outer": outer, "model": model}


def _expected(made: dict) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    plan = made["plan"]
    fresh = {n: torch.empty_like(p) for n, p in made["model"].named_parameters()}
    for f in range(len(plan)):
        plan.write(fresh, f, made["outer"].global_vector(f))
    params.update(fresh)
    return params


@pytest.mark.parametrize("layout", [True, False], ids=["layout", "older checkpoint"])
def test_export_writes_the_global_parameters_under_the_models_names(
    tmp_path: Path, layout: bool
) -> None:
    made = _checkpoint(tmp_path, 4, 0.5, layout=layout)
    done = export_model(tmp_path, tmp_path / "out" / "model.safetensors")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    expected = _expected(made)
    assert set(tensors) == set(made["model"].state_dict())
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name  # the global values, not the local
    # a fresh model loads it as is
    fresh = build_model(CFG, seed=2)
    fresh.load_state_dict(tensors, strict=True)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and meta["round"] == "4" and meta["run_id"] == "run-x"
    assert meta["global_digest"] == "ab" * 32 and meta["plan"] == made["plan"].digest()
    assert done["tensors"] == len(tensors)
    # the file's parameters hash to the digest in its metadata; one changed value does not
    assert meta["parameters_sha256"] == parameters_digest(tensors)
    name = next(iter(expected))
    tensors[name].view(-1)[0] += 1
    assert meta["parameters_sha256"] != parameters_digest(tensors)


def test_export_takes_the_newest_valid_checkpoint_or_the_round_asked(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 3, 0.25)
    newest = _checkpoint(tmp_path, 5, 0.75)
    out = tmp_path / "m.safetensors"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    name = next(iter(_expected(newest)))
    assert torch.equal(load_file(out)[name], _expected(newest)[name])
    # the newest is damaged: the one before it is taken
    newest_file = sorted((tmp_path / "checkpoints").glob("ckpt-*.pt"))[-1]
    data = bytearray(newest_file.read_bytes())
    data[-10] ^= 0xFF
    newest_file.write_bytes(bytes(data))
    assert export_model(tmp_path, out)["round"] == "3"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out), "--round", "3"]) == 0


def test_export_errors_are_clear(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "m.safetensors")
    assert main(["export", "--data-dir", str(tmp_path), "--out", out]) == 2
    assert "no valid checkpoint in" in capsys.readouterr().err
    _checkpoint(tmp_path, 2, 0.1)
    assert main(["export", "--data-dir", str(tmp_path), "--out", out, "--round", "9"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of round 9" in err and "(kept: 2)" in err
    assert not (tmp_path / "m.safetensors").exists()
