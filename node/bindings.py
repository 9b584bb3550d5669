"""What a run binds besides its settings: the model's config, its first weights and the
tokenizer of its data.

A node's config names files (``model.hf_config``, ``model.init_from``,
``data.shards``) that lie at other paths on other machines; what must be the same on
every node is what is in them. :func:`bind` fills in their digests
(``model.config_digest``, ``model.init_digest``, ``data.tokenizer_digest``) and, for a
preset without ``model.vocab_size``, the tokenizer's vocabulary size; a digest the
config already holds (from a run spec) must match the files, or the node stops at
start with one line naming the key. Nodes then compare these values like any other
shared setting (:func:`node.spec.settings_digest`).
"""

from __future__ import annotations

import dataclasses

from node.config import AtollConfig, ConfigError
from node.sources import BYTES_DIGEST

__all__ = ["bind"]


def bind(cfg: AtollConfig) -> AtollConfig:
    """``cfg`` with the digests of the files it names filled in (see the module docstring).

    Raises:
        ConfigError: a digest ``cfg`` holds that its files do not have, or a file that
            cannot be read.
        DataError: ``data.shards`` without a readable ``meta.json``.
    """
    model, data = cfg.model, cfg.data
    tokenizer, data_vocab = BYTES_DIGEST, None
    if data.shards:
        from node.data import read_meta

        meta = read_meta(data.shards)
        tokenizer = meta["tokenizer"]["digest"]
        if tokenizer != BYTES_DIGEST:
            data_vocab = meta.get("vocab_size")
    _check("data.tokenizer_digest", data.tokenizer_digest, tokenizer, "data.shards' tokenizer")
    model_updates: dict[str, object] = {}
    if model.arch == "hf":
        from node.hf import config_digest, load_config_dict, weights_digest

        if not model.vocab_size and model.preset and data_vocab:
            model_updates["vocab_size"] = data_vocab
            model = dataclasses.replace(model, vocab_size=data_vocab)
        source = next(
            f"model.{k}" for k in ("preset", "hf_config", "init_from") if getattr(model, k)
        )
        digest = config_digest(load_config_dict(model))
        _check("model.config_digest", model.config_digest, digest, f"{source}'s config")
        model_updates["config_digest"] = digest
        if model.init_from:
            weights = weights_digest(model.init_from)
            _check("model.init_digest", model.init_digest, weights, "model.init_from's weights")
            model_updates["init_digest"] = weights
    return cfg.replace(model=model_updates, data={"tokenizer_digest": tokenizer})


def _check(key: str, bound: str, actual: str, source: str) -> None:
    if bound and bound != actual:
        raise ConfigError(
            f"config error: {key} = {bound[:16]!r} (the run's) but {source} is "
            f"{actual[:16]!r}: use the run's files, or leave {key} unset without a run spec"
        )
