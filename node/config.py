"""Typed node configuration: TOML file plus ``--set key=value`` overrides, validated once.

:class:`AtollConfig` nests one frozen dataclass per ``[section]``: those of
:mod:`node.config_training` (run, model, data, train, outer), of
:mod:`node.config_network` (sync, network, control, metrics) and the trust policy of
:mod:`verification.policy`. Validation is pydantic's, and every error is reported as one
line naming the key, the value given and what was expected::

    config error: sync.codec = 'avg': expected one of none, fp16, bf16, int8, int4

The builders of each component's settings object from a validated config are in
:mod:`node.settings`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from node.config_network import ControlConfig, MetricsConfig, NetworkConfig, SyncConfig
from node.config_training import DataConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from verification.policy import TrustPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "AtollConfig",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "NetworkConfig",
    "OuterConfig",
    "RunConfig",
    "SyncConfig",
    "TrainConfig",
    "build_config",
    "load_config",
    "load_config_data",
    "parse_overrides",
]

_STRICT = ConfigDict(extra="forbid")


class ConfigError(ValueError):
    """A configuration file or override that does not validate."""


@dataclass(frozen=True, config=_STRICT)
class AtollConfig:
    """Everything one node needs to know, one nested dataclass per component."""

    run: RunConfig = Field(default_factory=RunConfig)
    """``[run]``: the run's identity, the node's files and device, when it stops."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """``[model]``: the model every node of the run trains."""
    data: DataConfig = Field(default_factory=DataConfig)
    """``[data]``: the text or token shards this node trains on."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """``[train]``: the inner optimizer and its schedule."""
    outer: OuterConfig = Field(default_factory=OuterConfig)
    """``[outer]``: the DiLoCo outer optimizer."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """``[sync]``: when fragments sync and how they are encoded and averaged."""
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """``[network]``: where the node listens, whom it joins, groups, deadlines and limits."""
    control: ControlConfig = Field(default_factory=ControlConfig)
    """``[control]``: the control channel: heartbeats, commitments and verdicts."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """``[metrics]``: the node's HTTP endpoint for metrics, state and its health page."""
    trust: TrustPolicy = Field(default_factory=TrustPolicy)
    """``[trust]``: the operator's trust policy (:class:`~verification.policy.TrustPolicy`)."""

    def __post_init__(self) -> None:
        from verification.aggregators import SPARSE_SAFE

        if self.sync.codec == "topk" and self.trust.aggregator not in SPARSE_SAFE:
            raise ValueError(
                f"trust.aggregator = {self.trust.aggregator!r} cannot work with sync.codec = "
                f"'topk' (coordinate-wise on sparse parts it drops almost every value): use "
                f"one of {', '.join(sorted(SPARSE_SAFE))}"
            )
        if self.sync.exchange == "gather" and not (self.control.enabled and self.control.commit):
            raise ValueError(
                "sync.exchange = 'gather' needs control.commit = true: every member takes "
                "each part only as the digest its sender committed to the group, or one "
                "member could be sent other values than the rest"
            )
        if self.sync.exchange == "gather" and self.network.stream_reduce:
            raise ValueError(
                "sync.exchange = 'gather' with network.stream_reduce = true: in a gather "
                "every member reduces whole parts itself and streams nothing back; set "
                "network.stream_reduce = false or sync.exchange = 'reduce'"
            )
        if self.trust.checkers and not (self.control.enabled and self.control.commit):
            raise ValueError(
                f"trust.checkers = {self.trust.checkers} needs control.commit = true (a "
                "checker compares the contribution it fetches with the one committed)"
            )
        if self.trust.replay_steps and self.train.sharding == "fsdp":
            raise ValueError(
                "trust.replay_steps with train.sharding = 'fsdp': a window's start state "
                "would have to be gathered from every shard; use 'ddp' or set "
                "trust.replay_steps = 0"
            )
        if self.trust.replay_steps and self.trust.checkers and self.sync.alpha:
            raise ValueError(
                f"trust.replay_steps with sync.alpha = {self.sync.alpha:g}: checkers hold a "
                "contribution to the sum of its trace's windows, which it is only with "
                "sync.alpha = 0; set sync.alpha = 0 or trust.replay_steps = 0"
            )
        # On the wall clock an exchange must end before its fragment syncs again.
        if self.sync.trigger == "seconds":
            waits = self.network.matchmaking_seconds
            named = f"network.matchmaking_seconds ({waits:g})"
            if self.control.commit:
                waits += self.control.commit_seconds
                named += f" + control.commit_seconds ({self.control.commit_seconds:g})"
            if waits >= 0.8 * self.sync.round_seconds:
                raise ValueError(
                    f"{named} leave no time for the all-reduce in a round of "
                    f"sync.round_seconds = {self.sync.round_seconds:g}: lengthen the round "
                    "or shorten the waits (they may take at most 80 % of it)"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (TOML/JSON friendly)."""
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> AtollConfig:
        """A copy with whole sections or ``section={"key": value}`` updates applied."""
        data = self.to_dict()
        for section, values in sections.items():
            if isinstance(values, dict):
                data.setdefault(section, {}).update(values)
            else:
                data[section] = dataclasses.asdict(values)
        return build_config(data)


_RENAMED = {
    "trust.check_batches": "trust.check_windows (windows of claimed batches per check)",
    "trust.check_pass_rate": "trust.check_min_work and trust.check_min_specific",
}
"""Keys that were renamed: the old name, and what it is called now."""


def _format_error(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        if key in _RENAMED:
            return f"config error: unknown key {key!r}: it is now {_RENAMED[key]}"
        return f"config error: unknown key {key!r}"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "").replace("'", "").replace(" or ", ", ")
        return f"config error: {key} = {value!r}: expected one of {expected}"
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        return f"config error: {key}: {msg}" if key else f"config error: {msg}"
    return f"config error: {key} = {value!r}: {err['msg'].lower()}"


def build_config(data: dict[str, Any]) -> AtollConfig:
    """Validate a nested dict into an :class:`AtollConfig`.

    Raises:
        ConfigError: naming the first offending key, the value and what was expected.
    """
    if not isinstance(data, dict):
        raise ConfigError("config error: top level must be a table")
    for section, values in data.items():
        if section in _SECTIONS and not isinstance(values, dict):
            raise ConfigError(f"config error: [{section}] must be a table, got {values!r}")
    try:
        return AtollConfig(**data)
    except ValidationError as exc:
        errors = exc.errors()
        raise ConfigError("\n".join(_format_error(e) for e in errors)) from None
    except TypeError as exc:
        raise ConfigError(f"config error: {exc}") from None


_SECTIONS = tuple(f.name for f in dataclasses.fields(AtollConfig))


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ``["sync.codec=int8", "train.lr=1e-3"]`` into a nested dict.

    Values are parsed as TOML values (numbers, booleans, arrays, quoted strings);
    anything that is not valid TOML is taken as a bare string.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"config error: override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"config error: override {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.setdefault(parts[0], {})[parts[1]] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | Sequence[str | Path] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> AtollConfig:
    """Load TOML configs (the defaults when ``path`` is None) and apply overrides.

    Several files are merged in order, later keys winning, so a trust policy file
    (``configs/trust/strict.toml``) can be layered over a node config.

    Raises:
        ConfigError: unreadable file, TOML syntax error, or a value that does not validate.
    """
    return build_config(load_config_data(path, overrides))


def load_config_data(
    path: str | Path | Sequence[str | Path] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The raw nested dict :func:`load_config` validates: files merged, overrides applied.

    Only the keys the files and overrides set are present (no defaults), so a caller
    can tell what a node chose from what it left alone (:func:`node.spec.apply_spec`).

    Raises:
        ConfigError: unreadable file, TOML syntax error, or a malformed override.
    """
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    data: dict[str, Any] = {}
    for item in paths:
        item = Path(item)
        try:
            text = item.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"config error: cannot read {item}: {exc.strerror}") from None
        try:
            data = _merge(data, tomllib.loads(text))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config error: {item}: {exc}") from None
    return _merge(data, parse_overrides(overrides))
