"""`atoll export --format hf` and `atoll sample`: the agreed global parameters as a folder
transformers loads offline, logits equal to the node's global model; text from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from node.cli import main
from node.config import load_config
from node.data.corpus import stdlib_files
from node.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from node.ops.handoff import export_hf, global_model, sample, workload_record
from node.train.checkpoint import save_checkpoint
from node.train.model import build_model
from node.train.outer import OuterOptimizer
from protocol.averaging.fragments import plan_fragments

FAMILIES = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
"""The class each family's export must name in ``architectures`` (serving stacks pick
the model class from it); the llama config below names it itself, the others not."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok") / "tokenizer"
    texts = [p.read_text() for _, p in stdlib_files()[:10]]
    save_tokenizer(train_tokenizer(texts, 300), folder)
    return folder


def _node_checkpoint(
    data_dir: Path, overrides: list[str], tokenizer: Path | None
) -> torch.nn.Module:
    """A checkpoint as a node writes it (global copies apart from the local model); the
    node's global model, as it evaluates it."""
    cfg = load_config(None, ["model.context=64", *overrides])
    model = build_model(cfg.model, seed=1)
    plan = plan_fragments(model, 2)
    outer = OuterOptimizer(model, plan, cfg.outer)
    for f in range(len(plan)):
        outer.set_global(f, outer.global_vector(f) + 0.01 * (f + 1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the local copy moved on: export must not take it
    entry = {"digest": "bytes"}
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        entry = {**tok.meta(), "folder": str(tokenizer)}
    state = {
        "round": 4,
        "run_id": "run-hf",
        "global_digest": "cd" * 32,
        "plan": plan.digest(),
        "layout": [[list(f.names), [list(s) for s in f.shapes]] for f in plan.fragments],
        "model": model.state_dict(),
        "outer": outer.state_dict(),
        "inner": None,
        "steps": 40,
        "tokens": 400,
        "workload": workload_record(cfg, entry),
    }
    save_checkpoint(data_dir / "checkpoints", 4, state)
    reference = build_model(cfg.model, seed=5)
    outer.write_globals(reference)
    return reference.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_exported_model_loads_offline_with_the_nodes_logits(
    tmp_path: Path, tokenizer_dir: Path, family: str
) -> None:
    config = tmp_path / "config.json"
    named = {"architectures": [CLASSES[family]]} if family == "llama" else {}
    config.write_text(json.dumps({**FAMILIES[family], **named, "vocab_size": 300}))
    reference = _node_checkpoint(
        tmp_path / "node",
        ["model.arch='hf'", f"model.hf_config={json.dumps(str(config))}"],
        tokenizer_dir,
    )
    done = export_hf(tmp_path / "node", tmp_path / "out")
    assert done["model_type"] == family and done["round"] == "4"
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [CLASSES[family]]
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    lm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    # transformers gives a qwen2 model Qwen2Tokenizer, which re-splits text its own way:
    # the export says so, and the tokenizer trained with loads as PreTrainedTokenizerFast
    assert done["auto_tokenizer"] == ("Qwen2Tokenizer" if family == "qwen2" else None)
    loader = PreTrainedTokenizerFast if family == "qwen2" else AutoTokenizer
    hf_tok = loader.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ours = load_tokenizer(tokenizer_dir)
    text = "def f(x):\n    return x + 1\n"
    ids = hf_tok(text).input_ids
    assert ids == ours.encode(text) and hf_tok.eos_token_id == ours.eos_id == lm.config.eos_token_id
    batch = torch.randint(0, 300, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(lm(batch).logits, reference(batch), rtol=0, atol=1e-5)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["format"] == "pt" and meta["atoll_format"] == "atoll-hf-v1"
    assert (meta["run_id"], meta["round"], meta["global_digest"]) == ("run-hf", "4", "cd" * 32)
    tied = FAMILIES[family].get("tie_word_embeddings", True)
    assert ("lm_head.weight" in keys) != tied  # a tied output layer is stored once


def test_the_byte_model_exports_as_gpt2_with_a_byte_tokenizer(tmp_path: Path) -> None:
    small = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4"]
    reference = _node_checkpoint(tmp_path / "node", small, None)
    done = export_hf(tmp_path / "node", tmp_path / "out")
    assert done["model_type"] == "gpt2"
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [CLASSES["gpt2"]]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok("héllo").input_ids == list("héllo".encode())
    batch = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(lm(batch).logits, reference(batch), rtol=0, atol=1e-5)


def test_export_refuses_a_used_folder_and_an_older_checkpoint(tmp_path: Path, capsys) -> None:
    _node_checkpoint(
        tmp_path / "node", ["model.n_layer=1", "model.n_embd=16", "model.n_head=2"], None
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    args = [
        "export",
        "--format",
        "hf",
        "--data-dir",
        str(tmp_path / "node"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(args) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").exists()
    assert main([*args, "--force"]) == 0
    assert "load it with AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    assert not (tmp_path / "out" / "keep.txt").exists()
    # a checkpoint from before checkpoints said which model they hold
    from node.train.checkpoint import load_latest

    info, state = load_latest(tmp_path / "node" / "checkpoints")
    del state["workload"]
    save_checkpoint(tmp_path / "old" / "checkpoints", 5, state)
    with pytest.raises(ValueError, match="written by an older atoll"):
        global_model(tmp_path / "old")


def test_sample_prints_a_continuation_from_the_global_parameters(
    tmp_path: Path, tokenizer_dir: Path, capsys
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**FAMILIES["llama"], "vocab_size": 300}))
    _node_checkpoint(
        tmp_path / "node",
        ["model.arch='hf'", f"model.hf_config={json.dumps(str(config))}"],
        tokenizer_dir,
    )
    greedy, source = sample(tmp_path / "node", "import os", max_tokens=12, temperature=0)
    assert source["round"] == "4" and greedy == sample(tmp_path / "node", "import os", 12, 0)[0]
    assert len(load_tokenizer(tokenizer_dir).encode(greedy)) <= 12
    args = [
        "sample",
        "--data-dir",
        str(tmp_path / "node"),
        "--prompt",
        "import os",
        "--max-tokens",
        "12",
    ]
    assert main(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith("import os") and "round 4 of run run-hf" in out.err
    assert main([*args[:-2], "--max-tokens", "0"]) == 2
