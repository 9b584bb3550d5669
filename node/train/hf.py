"""Hugging Face causal LMs: shipped presets, offline loading, and the logits adapter.

``[model] arch = "hf"`` builds a causal LM with ``transformers`` from one of three
sources, never from a hub (``node/__init__`` sets offline mode; loads pass
``local_files_only``):

* ``preset = NAME``: a config shipped in ``node/presets/`` (:data:`PRESETS`);
* ``hf_config = PATH``: a local ``config.json``;
* ``init_from = DIR``: a local checkpoint folder (``config.json`` and
  ``*.safetensors``), whose weights the run starts from (continued pretraining).

The config is a plain JSON dict until the model is built; its digest
(:func:`config_digest`) is what a run spec binds, so every node trains the same
architecture. Random weights come from the run's seed (:func:`node.train.model.build_model`
seeds the generator), identical on every node. :class:`CausalLM` wraps the model so
that, like the byte model, ``model(tokens)`` returns logits; tied input and output
embeddings are one parameter, so the fragment plan holds them once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.config import ConfigError, ModelConfig

__all__ = [
    "PRESETS",
    "CausalLM",
    "build_hf",
    "config_digest",
    "hf_config_of",
    "load_config_dict",
    "weights_digest",
]

_PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"

PRESETS: dict[str, str] = {
    "llama-tiny": "Llama, 4 layers of 256, GQA, tied embeddings: a few million "
    "parameters, trains on two CPU cores",
    "qwen2-tiny": "Qwen2 (q/k/v biases), 4 layers of 256, tied embeddings",
    "llama-150m": "Llama, 12 layers of 768, 12 heads: about 150 M parameters",
    "gpt2-small": "GPT-2 small, 12 layers of 768 (learned positions, tied embeddings)",
    "llama-1b": "Llama, 22 layers of 2048, 32 heads and 4 KV heads (TinyLlama's "
    "shape): 1.1 B parameters",
}
"""Shipped model configs (``model.preset``) and what each is."""

_VOLATILE = ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype")
"""Config keys that say how a file was written, not what the model is."""


def _read_json(path: Path, key: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config error: model.{key}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: model.{key}: cannot read {path} ({exc})") from None
    except ValueError as exc:
        raise ConfigError(f"config error: model.{key}: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            f"config error: model.{key}: {path} is not a Hugging Face model config (no model_type)"
        )
    return data


def load_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config ``cfg`` names, as a plain dict, with ``model.vocab_size``
    applied where it is set.

    Raises:
        ConfigError: an unknown preset, a missing or malformed file, or a vocabulary
            size that ``init_from``'s weights cannot take.
    """
    if not (cfg.preset or cfg.hf_config or cfg.init_from):
        raise ConfigError(
            "config error: model.arch = 'hf' needs model.preset, model.hf_config or model.init_from"
        )
    if cfg.preset:
        if cfg.preset not in PRESETS:
            raise ConfigError(
                f"config error: model.preset = {cfg.preset!r}: expected one of {', '.join(PRESETS)}"
            )
        data = _read_json(_PRESET_DIR / f"{cfg.preset}.json", "preset")
    elif cfg.hf_config:
        data = _read_json(Path(cfg.hf_config).expanduser(), "hf_config")
    else:
        folder = Path(cfg.init_from).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"config error: model.init_from: {folder} is not a folder (expected a "
                "checkpoint folder written by save_pretrained)"
            )
        data = _read_json(folder / "config.json", "init_from")
    data = {k: v for k, v in data.items() if k not in _VOLATILE}
    if cfg.vocab_size and data.get("vocab_size") != cfg.vocab_size:
        if cfg.init_from:
            raise ConfigError(
                f"config error: model.vocab_size = {cfg.vocab_size} but model.init_from's "
                f"weights have {data.get('vocab_size')} tokens: leave model.vocab_size unset"
            )
        data["vocab_size"] = cfg.vocab_size
    return data


def config_digest(data: dict[str, Any]) -> str:
    """SHA-256 of a model config as written (keys sorted, volatile keys left out)."""
    kept = {k: v for k, v in data.items() if k not in _VOLATILE}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def weights_digest(folder: str | Path) -> str:
    """SHA-256 over a checkpoint folder's ``*.safetensors`` files, by name.

    Raises:
        ConfigError: the folder holds no safetensors file.
    """
    root = Path(folder).expanduser()
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"config error: model.init_from: no *.safetensors file in {root} (write the "
            "checkpoint with save_pretrained, which writes safetensors)"
        )
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def hf_config_of(data: dict[str, Any]) -> Any:
    """A ``transformers`` config object from a plain config dict.

    Raises:
        ConfigError: a model type ``transformers`` does not know.
    """
    from transformers import AutoConfig

    rest = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(data["model_type"], **rest)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"config error: model_type {data['model_type']!r}: {str(exc).splitlines()[0]}"
        ) from None


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose forward returns logits, as the byte model's does.

    Args:
        lm: the ``transformers`` model (``...ForCausalLM``); its parameters are this
            module's under the prefix ``lm.``.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.context = int(getattr(lm.config, "max_position_embeddings", 0) or 0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T)`` token ids to ``(B, T, vocab)`` next-token logits."""
        if self.context and idx.shape[1] > self.context:
            raise ValueError(
                f"sequence length {idx.shape[1]} exceeds the model's "
                f"max_position_embeddings {self.context}"
            )
        return self.lm(input_ids=idx, use_cache=False).logits

    def enable_activation_checkpointing(self) -> None:
        self.lm.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )


def build_hf(cfg: ModelConfig) -> CausalLM:
    """Build the configured model in float32 on the CPU: random weights from the torch
    generator as it stands (the caller seeds it), or ``init_from``'s.

    Raises:
        ConfigError: as :func:`load_config_dict`, or a config whose model is not a
            causal LM, or a ``model.context`` beyond its positions.
    """
    from transformers import AutoModelForCausalLM

    data = load_config_dict(cfg)
    config = hf_config_of(data)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and cfg.context > positions:
        raise ConfigError(
            f"config error: model.context = {cfg.context} exceeds the model's "
            f"max_position_embeddings ({positions})"
        )
    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    try:
        if cfg.init_from:
            lm = AutoModelForCausalLM.from_pretrained(
                str(Path(cfg.init_from).expanduser()), local_files_only=True, **kwargs
            )
        else:
            lm = AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as exc:
        raise ConfigError(
            f"config error: model_type {data['model_type']!r} is not a causal LM "
            f"transformers can build: {str(exc).splitlines()[0]}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config error: model.init_from: {exc}") from None
    lm.train()
    return CausalLM(lm)
