"""The models a node trains: a small byte-level GPT, a Hugging Face causal LM, or any
user factory.

The built-in model reads bytes (vocabulary 256; ``model.vocab_size`` for a corpus of
other tokens) and predicts the next one; its default size trains visibly on two CPU
cores in minutes. ``model.arch = "hf"`` builds a ``transformers`` causal LM instead
(:mod:`node.train.hf`). ``model.factory = "package.module:function"`` replaces both with any
``nn.Module`` whose forward maps ``(B, T)`` int64 tokens to ``(B, T, vocab)`` logits;
the function receives the :class:`~node.config.ModelConfig`.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from node.config import ModelConfig

__all__ = [
    "VOCAB_SIZE",
    "ByteGPT",
    "build_model",
    "enable_activation_checkpointing",
    "vocab_of",
]

VOCAB_SIZE = 256
"""Bytes: the default ``model.vocab_size``."""


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes (GPT-2 layout, pre-norm, learned positions)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(
                f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})"
            )
        vocab = cfg.vocab_size or VOCAB_SIZE
        self.context = cfg.context
        self.checkpointing = False
        self.tok = nn.Embedding(vocab, cfg.n_embd)
        self.pos = nn.Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, vocab, bias=False)
        self.apply(self._init)
        # GPT-2 scales residual projections by depth so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T)`` token ids to ``(B, T, vocab_size)`` next-token logits."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds model.context {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    def enable_activation_checkpointing(self) -> None:
        self.checkpointing = True


def vocab_of(cfg: ModelConfig) -> int:
    """How many tokens the configured model knows (``model.vocab_size``, or the
    architecture's own: 256 bytes, a Hugging Face config's ``vocab_size``)."""
    if cfg.vocab_size:
        return cfg.vocab_size
    if cfg.arch == "hf":
        from node.train.hf import load_config_dict

        return int(load_config_dict(cfg)["vocab_size"])
    return VOCAB_SIZE


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """Build the configured model with deterministic initial weights for ``seed``.

    Raises:
        ValueError: a factory string that is malformed, cannot be imported, or does not
            return an ``nn.Module``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.arch == "hf":
            from node.train.hf import build_hf

            return build_hf(cfg)
        if not cfg.factory:
            return ByteGPT(cfg)
        module_name, sep, func_name = cfg.factory.partition(":")
        if not sep or not module_name or not func_name:
            raise ValueError(f"model.factory = {cfg.factory!r}: expected 'package.module:function'")
        try:
            func = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model.factory = {cfg.factory!r}: {exc}") from None
        model = func(cfg)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model.factory = {cfg.factory!r} returned {type(model).__name__}, not nn.Module"
            )
        return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute ``model``'s blocks in the backward pass (``train.activation_checkpointing``).

    Raises:
        ValueError: a factory model that does not offer it.
    """
    enable = getattr(model, "enable_activation_checkpointing", None)
    if enable is None:
        raise ValueError(
            f"train.activation_checkpointing: {type(model).__name__} does not offer it (a "
            "factory model can define enable_activation_checkpointing())"
        )
    enable()
