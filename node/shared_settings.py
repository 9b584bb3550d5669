"""The settings every node of a run shares, and the digest nodes compare them by.

:data:`SHARED_KEYS` names them (the model, the tokenizer and the data, the outer step,
the sync schedule and codec, the grouping, the control channel and the aggregator); a
signed run spec (:mod:`node.spec`) fixes their values, and a node started without one
announces :func:`settings_digest` so peers on other settings are told apart.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Annotated, Any

import msgpack
from pydantic import TypeAdapter, ValidationError

from node.config import AtollConfig, ModelConfig, OuterConfig

__all__ = ["SHARED_KEYS", "canonical", "same_value", "settings_digest", "shared_settings"]

_SETTINGS_DOMAIN = b"atoll/settings/v1\0"


def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


SHARED_KEYS: dict[str, tuple[str, ...]] = {
    # The run's name, and the seed the model is initialised from: nodes must start
    # from the same weights or averaging mixes unrelated models. And who may sign the
    # spec's next version.
    "run": ("run_id", "seed", "spec_signers"),
    # The architecture: parameters must line up tensor by tensor on every node. Paths
    # are each node's own; what they hold is bound by digest (node.train.bindings).
    "model": tuple(k for k in _keys(ModelConfig) if k not in ("hf_config", "init_from")),
    # Tokens must mean the same on every node: the tokenizer is bound by digest. And
    # every node must hold the same tokens: peers recompute the batches a node was
    # assigned from its key, which only checks its work if they read the same data.
    "data": ("tokenizer_digest", "dataset_digest"),
    # Every group member applies the outer step to the same global values; another
    # lr or momentum would make the members' copies of the global model drift apart.
    "outer": _keys(OuterConfig),
    # When and how fragments are exchanged: the round clock, the fragment plan, the
    # wire codec and the averaging schedule must agree or exchanges never meet or
    # cannot be decoded. tau and alpha (how late results merge locally) stay local.
    "sync": (
        "trigger",
        "inner_steps",
        "round_seconds",
        "fragments",
        "codec",
        "block_size",
        "topk_chunk",
        "topk_density",
        "topk_bits",
        "feedback_decay",
        "error_feedback",
        "stochastic_rounding",
        "averaging",
        "layout",
        "gossip_gamma",
        "mix_codec",
        "exchange",
    ),
    # The group size decides who averages with whom on the butterfly schedule; nodes
    # on other registry keys never see each other, and nodes that matchmake on the
    # cell grid never meet nodes that read every announcement.
    "network": ("group_size", "registry_shards", "cells_above"),
    # With commit on, a node refuses parts sent without a commitment, so one node
    # with the control channel or commitments off would have all its work refused.
    "control": ("enabled", "commit"),
    # Each part of a fragment is reduced by one member for the whole group; the
    # robustness a run promises holds only if every part uses the same rule.
    # Who checks whom, on which batches and from which round follow from these: nodes
    # that drew checkers differently would refuse each other's records.
    "trust": (
        "aggregator",
        "checkers",
        "check_windows",
        "check_fragments",
        "check_from_round",
        "check_assigned",
        "replay_steps",
    ),
}
"""The settings every node of a run must share: ``{section: (key, ...)}``."""


def settings_digest(cfg: AtollConfig) -> str:
    """Hex SHA-256 of ``cfg``'s shared settings, for nodes started without a spec.

    Two configs get the same digest exactly when every key of :data:`SHARED_KEYS`
    has the same value; local settings (``train.lr``, ``run.data_dir``...) do not count.
    """
    payload = msgpack.packb(canonical(shared_settings(cfg)), use_bin_type=True)
    return hashlib.sha256(_SETTINGS_DOMAIN + payload).hexdigest()


def shared_settings(cfg: AtollConfig) -> dict[str, dict[str, Any]]:
    """``cfg``'s values of every key of :data:`SHARED_KEYS`, canonical."""
    data = cfg.to_dict()
    return {
        section: {key: canonical(data[section][key]) for key in keys}
        for section, keys in SHARED_KEYS.items()
    }


def canonical(value: Any) -> Any:
    """Dicts with sorted keys and lists for tuples, at every level: one msgpack encoding."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    return value


@functools.cache
def _adapter(section: str, key: str) -> TypeAdapter:
    """Validates one config key's value alone, with its type and bounds."""
    table = AtollConfig.__pydantic_fields__[section].annotation
    field = table.__pydantic_fields__[key]
    kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(kind)


def same_value(section: str, key: str, ours: Any, theirs: Any) -> bool:
    """Whether two values of a key are equal once validated (``20`` and ``20.0`` are)."""
    adapter = _adapter(section, key)
    try:
        return adapter.validate_python(ours) == adapter.validate_python(theirs)
    except ValidationError:
        return False
