"""Handing the trained model back: a ``from_pretrained`` folder, and text from it.

Beside the global parameters, a node's checkpoints carry what it takes to rebuild its
model and tokenizer on another machine (:func:`workload_record`): the model settings,
the Hugging Face config as a dict, and the tokenizer's files. From them:

* ``atoll export --format hf`` (:func:`export_hf`) writes a folder that
  ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load
  offline: ``config.json``, ``generation_config.json``, ``model.safetensors`` (with the
  run id, round and global digest in its metadata, tied weights once) and the
  tokenizer's files. The byte model exports as the GPT-2 it is laid out as (exact GELU,
  an untied output layer) with a byte tokenizer (ids are byte values).
* ``atoll sample`` (:func:`sample`) prints a continuation of a prompt from the same
  global parameters, so an operator sees what the swarm has learned.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.config import AtollConfig, ModelConfig

__all__ = ["HF_FORMAT", "export_hf", "global_model", "sample", "workload_record"]

HF_FORMAT = "atoll-hf-v1"
"""``atoll_format`` in an exported ``model.safetensors``'s metadata."""


def workload_record(cfg: AtollConfig, tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint keeps to rebuild the model and its tokenizer elsewhere.

    Args:
        cfg: the node's (bound) config.
        tokenizer: the corpus's tokenizer entry (:attr:`node.data.corpus.Corpus.tokenizer`).
    """
    from node.data.tokenizer import read_files

    hf_config = None
    if cfg.model.arch == "hf":
        from node.train.hf import load_config_dict

        hf_config = load_config_dict(cfg.model)
    entry = dict(tokenizer or {"digest": "bytes"})
    folder = entry.pop("folder", None)
    files = read_files(Path(folder)) if folder else None
    return {
        "model": dataclasses.asdict(cfg.model),
        "hf_config": hf_config,
        "tokenizer": {"meta": entry, "files": files},
    }


def _build(record: dict[str, Any]) -> nn.Module:
    """The model a record describes, with random weights (they are replaced)."""
    model_cfg = ModelConfig(**record["model"])
    if record.get("hf_config") is None:
        from node.train.model import build_model

        if model_cfg.factory:
            raise ValueError(
                "the checkpoint's model comes from model.factory: export it with "
                "--format atoll (safetensors under the model's own names)"
            )
        return build_model(model_cfg)
    from transformers import AutoModelForCausalLM

    from node.train.hf import CausalLM, hf_config_of

    config = hf_config_of(record["hf_config"])
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return CausalLM(lm)


def global_model(
    data_dir: Path, round_: int | None = None
) -> tuple[nn.Module, dict[str, Any], dict[str, str]]:
    """The global parameters of the newest valid checkpoint (or of ``round_``) in the
    model they belong to, in eval mode; its workload record; where it comes from.

    Raises:
        ValueError: no checkpoint, or one written before checkpoints carried their
            workload.
    """
    from node.ops.export import checkpoint_metadata, global_tensors, load_state

    info, state = load_state(data_dir, round_)
    record = state.get("workload")
    if not isinstance(record, dict):
        raise ValueError(
            f"{info.path.name} was written by an older atoll and does not say which model it "
            "holds: export it with --format atoll"
        )
    model = _build(record)
    model.load_state_dict(global_tensors(state))
    model.eval()
    return model, record, checkpoint_metadata(info, state)


def _tokenizer(record: dict[str, Any]) -> Any:
    """The record's tokenizer (:class:`node.data.tokenizer.TokenizerInfo`)."""
    from tokenizers import Tokenizer

    from node.data.tokenizer import TokenizerInfo, byte_tokenizer

    tok = record["tokenizer"]
    if not tok.get("files"):
        return byte_tokenizer()
    meta = tok["meta"]
    backend = Tokenizer.from_str(tok["files"]["tokenizer.json"])
    return TokenizerInfo(
        backend, meta.get("eos_token"), meta.get("eos_id"), backend.get_vocab_size(), meta["digest"]
    )


def export_hf(
    data_dir: Path, out: Path, round_: int | None = None, force: bool = False
) -> dict[str, Any]:
    """Write a ``from_pretrained`` folder of the global parameters (see the module
    docstring); returns what was written.

    Raises:
        ValueError: ``out`` exists and is not empty (without ``force``), or as
            :func:`global_model`.
    """
    from safetensors.torch import save_file

    from node.ops.export import parameters_digest

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ValueError(f"--out {out} exists and is not empty; choose another or pass --force")
    model, record, source = global_model(data_dir, round_)
    tok = _tokenizer(record)
    lm = model.lm if record.get("hf_config") is not None else _as_gpt2(model, record)
    _set_special_tokens(lm, tok)
    tensors = _untied(lm.state_dict())
    metadata = {
        "format": "pt",  # what transformers expects of a PyTorch safetensors file
        "atoll_format": HF_FORMAT,
        "parameters_sha256": parameters_digest(tensors),
        **source,
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
        # serving stacks pick the model class from it (a config read as a run's leaves it
        # out, node/train/hf.py): the class the weights were built for
        lm.config.architectures = [type(lm).__name__]
        lm.config.save_pretrained(str(tmp))
        lm.generation_config.save_pretrained(str(tmp))
        _save_tokenizer(record, tok, tmp)
        auto = _auto_tokenizer_class(tmp, tok)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "path": str(out),
        "tensors": len(tensors),
        "model_type": lm.config.model_type,
        "auto_tokenizer": auto,
        **metadata,
    }


_PROBE = "Atoll's probe: naïve cafe\u0301, 12345 + 3.5e-6\n    def f(x):\n\treturn x  # ok\r\n"
"""Text that tokenizer pipelines split differently (digit runs, spaces before a line,
decomposed accents)."""


def _auto_tokenizer_class(folder: Path, tok: Any) -> str | None:
    """None when ``AutoTokenizer.from_pretrained(folder)`` encodes as the model was
    trained; else the class it picks. (transformers gives some model types, Qwen2 among
    them, their own tokenizer class, which keeps the vocabulary but splits text its own
    way.)"""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    same = auto(_PROBE, add_special_tokens=False).input_ids == tok.encode(_PROBE)
    return None if same else type(auto).__name__


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per tensor (the first: ``embed_tokens`` before its tied ``lm_head``),
    as ``save_pretrained`` writes them; loading ties them again."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = t.detach().contiguous()
    return out


def _set_special_tokens(lm: nn.Module, tok: Any) -> None:
    """The exported configs name the tokenizer's EOS (a preset names none)."""
    eos = tok.eos_id
    for config in (lm.config, lm.generation_config):
        config.eos_token_id = eos
        config.bos_token_id = eos
        config.pad_token_id = eos


def _save_tokenizer(record: dict[str, Any], tok: Any, folder: Path) -> None:
    from node.data.tokenizer import save_tokenizer, write_files

    files = record["tokenizer"].get("files")
    if files:
        write_files(files, folder)
    else:
        save_tokenizer(tok, folder)


def _as_gpt2(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """The byte model as ``transformers``' GPT-2: the same layout (pre-norm, learned
    positions, fused q/k/v), with exact GELU and an untied output layer; GPT-2's
    ``Conv1D`` keeps its weights transposed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = ModelConfig(**record["model"])
    state = model.state_dict()
    vocab, width = state["tok.weight"].shape
    config = GPT2Config(
        vocab_size=int(vocab),
        n_positions=cfg.context,
        n_embd=int(width),
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    gpt2 = GPT2LMHeadModel(config)
    mapped = {
        "transformer.wte.weight": state["tok.weight"],
        "transformer.wpe.weight": state["pos.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": state["ln_f.bias"],
        "lm_head.weight": state["head.weight"],
    }
    layers = {
        "ln_1": ("ln1", False),
        "attn.c_attn": ("qkv", True),
        "attn.c_proj": ("proj", True),
        "ln_2": ("ln2", False),
        "mlp.c_fc": ("fc", True),
        "mlp.c_proj": ("fc_out", True),
    }
    for i in range(cfg.n_layer):
        for theirs, (ours, conv) in layers.items():
            weight = state[f"blocks.{i}.{ours}.weight"]
            mapped[f"transformer.h.{i}.{theirs}.weight"] = weight.t() if conv else weight
            mapped[f"transformer.h.{i}.{theirs}.bias"] = state[f"blocks.{i}.{ours}.bias"]
    gpt2.load_state_dict({k: v.contiguous() for k, v in mapped.items()})
    return gpt2.eval()


@torch.no_grad()
def sample(
    data_dir: Path,
    prompt: str,
    max_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    round_: int | None = None,
) -> tuple[str, dict[str, str]]:
    """A continuation of ``prompt`` from the global parameters (top-k sampling at
    ``temperature``; 0 takes the likeliest token), ending early at the EOS token;
    and where the parameters come from.

    Raises:
        ValueError: as :func:`global_model`, or bad sampling settings.
    """
    if max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if temperature < 0 or top_k < 1:
        raise ValueError("--temperature must be >= 0 and --top-k >= 1")
    model, record, source = global_model(data_dir, round_)
    tok = _tokenizer(record)
    context = ModelConfig(**record["model"]).context
    ids = tok.encode(prompt)
    if not ids:
        ids = [tok.eos_id if tok.eos_id is not None else ord("\n")]
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([ids], dtype=torch.int64)
    new: list[int] = []
    for _ in range(max_tokens):
        logits = model(tokens[:, -context:])[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            values, index = torch.topk(logits / temperature, min(top_k, logits.numel()))
            choice = torch.multinomial(torch.softmax(values, -1), 1, generator=generator)
            nxt = int(index[choice])
        if nxt == tok.eos_id:
            break
        new.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return tok.decode(new), source
