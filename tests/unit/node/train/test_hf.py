"""Hugging Face causal LMs: presets, configs and checkpoints, built offline and alike on
every node, their tied embeddings once in the fragment plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.config import ConfigError, ModelConfig, load_config
from node.train.hf import PRESETS, CausalLM, config_digest, load_config_dict, weights_digest
from node.train.model import build_model, vocab_of
from protocol.averaging.fragments import plan_fragments

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def _config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_presets_build_the_same_weights_from_the_same_seed(preset: str) -> None:
    cfg = ModelConfig(arch="hf", preset=preset, vocab_size=300, context=32)
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    assert isinstance(a, CausalLM)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    logits = a(torch.randint(0, 300, (2, 16)))
    assert logits.shape == (2, 16, 300)


def test_every_preset_is_a_causal_lm_config() -> None:
    for name in PRESETS:
        data = load_config_dict(ModelConfig(arch="hf", preset=name))
        assert data["model_type"] in ("llama", "qwen2", "gpt2") and data["vocab_size"] > 256
    gpt2 = build_model(ModelConfig(arch="hf", preset="gpt2-small", vocab_size=300, context=32))
    assert gpt2(torch.randint(0, 300, (1, 8))).shape == (1, 8, 300)
    assert "lm.lm_head.weight" not in dict(gpt2.named_parameters())  # tied


def test_tied_embeddings_are_one_tensor_in_the_fragment_plan(tmp_path: Path) -> None:
    model = build_model(ModelConfig(arch="hf", hf_config=str(_config(tmp_path))), seed=0)
    plan = plan_fragments(model, 2)
    names = [n for f in plan.fragments for n in f.names]
    assert "lm.model.embed_tokens.weight" in names and "lm.lm_head.weight" not in names
    assert plan.numel == sum(p.numel() for p in model.parameters())
    # writing the embedding's fragment moves the output layer with it
    f = next(i for i, fr in enumerate(plan.fragments) if "lm.model.embed_tokens.weight" in fr.names)
    params = dict(model.named_parameters())
    plan.write(params, f, torch.full((plan[f].numel,), 0.5))
    assert torch.all(model.lm.lm_head.weight == 0.5)
    untied = build_model(
        ModelConfig(arch="hf", hf_config=str(_config(tmp_path, tie_word_embeddings=False)))
    )
    names = [n for f in plan_fragments(untied, 1).fragments for n in f.names]
    assert "lm.lm_head.weight" in names


def test_vocab_size_overrides_a_preset_and_defaults_to_its_own() -> None:
    assert vocab_of(ModelConfig(arch="hf", preset="llama-tiny")) == 8192
    assert vocab_of(ModelConfig(arch="hf", preset="llama-tiny", vocab_size=512)) == 512
    assert vocab_of(ModelConfig()) == 256


def test_init_from_starts_from_the_checkpoint_and_binds_its_weights(tmp_path: Path) -> None:
    trained = build_model(ModelConfig(arch="hf", hf_config=str(_config(tmp_path))), seed=7)
    folder = tmp_path / "ckpt"
    trained.lm.save_pretrained(str(folder))
    cfg = ModelConfig(arch="hf", init_from=str(folder))
    loaded = build_model(cfg, seed=0)  # the seed does not matter: weights come from disk
    for (name, a), (_, b) in zip(trained.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    before = weights_digest(folder)
    assert before == weights_digest(folder)
    state = trained.lm.state_dict()
    with torch.no_grad():
        state["model.norm.weight"].add_(1.0)
    trained.lm.save_pretrained(str(folder))
    assert weights_digest(folder) != before
    with pytest.raises(ConfigError, match="model.vocab_size = 512 but model.init_from's weights"):
        load_config_dict(ModelConfig(arch="hf", init_from=str(folder), vocab_size=512))


def test_config_digest_is_of_the_architecture_not_the_file(tmp_path: Path) -> None:
    data = load_config_dict(ModelConfig(arch="hf", hf_config=str(_config(tmp_path))))
    noisy = {**data, "transformers_version": "9.9.9", "_name_or_path": "/elsewhere"}
    assert config_digest(noisy) == config_digest(dict(reversed(list(data.items()))))
    assert config_digest({**data, "hidden_size": 64}) != config_digest(data)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"model.arch": "hf"}, "needs model.preset, model.hf_config or model.init_from"),
        ({"model.preset": "llama-tiny"}, "model.preset is for a Hugging Face model"),
        (
            {"model.arch": "hf", "model.preset": "llama-tiny", "model.hf_config": "x.json"},
            "model.preset and model.hf_config both set",
        ),
        ({"model.arch": "hf", "model.preset": "llama-7t"}, "expected one of llama-tiny"),
        ({"model.arch": "hf", "model.hf_config": "/no/such/config.json"}, "does not exist"),
        ({"model.arch": "hf", "model.init_from": "/no/such/dir"}, "is not a folder"),
    ],
)
def test_bad_model_settings_are_one_line_errors(settings: dict, message: str) -> None:
    overrides = [f"{k}={json.dumps(v)}" for k, v in settings.items()]
    with pytest.raises(ConfigError) as info:
        cfg = load_config(None, overrides)
        build_model(cfg.model)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_broken_config_files_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        build_model(ModelConfig(arch="hf", hf_config=str(bad)))
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="no model_type"):
        build_model(ModelConfig(arch="hf", hf_config=str(bad)))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        build_model(ModelConfig(arch="hf", hf_config=str(_config(tmp_path)), context=512))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ConfigError, match=r"no \*.safetensors file"):
        weights_digest(empty)
