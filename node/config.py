"""Typed node configuration: TOML file plus ``--set key=value`` overrides, validated once.

Each component owns a frozen dataclass of its settings; :class:`AtollConfig` nests them.
Validation is pydantic's, and every error is reported as one line naming the key, the
value given and what was expected::

    config error: sync.codec = 'avg': expected one of none, fp16, bf16, int8, int4
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass

from verification.policy import TrustPolicy

if TYPE_CHECKING:  # imported where used: protocol.p2p.transport loads hivemind
    from node.clock import ClockSettings
    from protocol.averaging.exchange import ExchangeSettings
    from protocol.averaging.parts import AllReduceSettings
    from protocol.p2p.transport import TransportConfig

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
    "allreduce_settings",
    "clock_settings",
    "exchange_settings",
    "load_config",
    "load_config_data",
    "parse_overrides",
    "transport_config",
]

_STRICT = ConfigDict(extra="forbid")

CodecName = Literal["none", "fp16", "bf16", "int8", "int4"]


class ConfigError(ValueError):
    """A configuration file or override that does not validate."""


@dataclass(frozen=True, config=_STRICT)
class RunConfig:
    """Identity of the run and where a node keeps its files."""

    run_id: str = Field(default="atoll-demo", min_length=1, max_length=64)
    seed: int = 0
    data_dir: str = ".atoll/node"
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = Field(default=0, ge=0)
    max_rounds: int = Field(default=0, ge=0)
    slowdown: float = Field(default=1.0, ge=1.0)
    checkpoint_every: int = Field(default=1, ge=1)
    keep_checkpoints: int = Field(default=3, ge=1)
    eval_every: int = Field(default=1, ge=1)
    clock_signers: tuple[str, ...] = ()
    """Without a run spec: the PeerIDs whose round-clock manifests this node takes
    (empty: the nodes it joins through, its initial peers)."""

    @field_validator("clock_signers")
    @classmethod
    def _signers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from verification.policy import is_peer_id

        for peer in value:
            if not is_peer_id(peer):
                raise ValueError(f"{peer!r} is not a PeerID (12D3KooW...)")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
            return value
        raise ValueError(f"{value!r}: expected auto, cpu, cuda or cuda:N")


@dataclass(frozen=True, config=_STRICT)
class ModelConfig:
    """The model: the reference byte-level GPT (``arch = "byte"``), a Hugging Face causal
    LM (``arch = "hf"``: a shipped ``preset``, an ``hf_config`` file or an ``init_from``
    checkpoint folder, built with ``transformers``, offline), or any
    ``package.module:function`` factory."""

    arch: Literal["byte", "hf"] = "byte"
    preset: str = ""
    """``arch = "hf"``: a shipped model config (``atoll models`` lists them)."""
    hf_config: str = ""
    """``arch = "hf"``: a local ``config.json`` of a Hugging Face causal LM."""
    init_from: str = ""
    """``arch = "hf"``: a local Hugging Face checkpoint folder (its ``config.json`` and
    ``*.safetensors``) to start from instead of random weights: continued pretraining."""
    config_digest: str = ""
    """SHA-256 of the Hugging Face model config (``preset``, ``hf_config`` or
    ``init_from``'s), filled in at start; a run spec binds it."""
    init_digest: str = ""
    """SHA-256 of ``init_from``'s weight files, filled in at start; a run spec binds it."""
    factory: str = ""
    n_layer: int = Field(default=2, ge=1, le=64)
    n_embd: int = Field(default=128, ge=8, le=8192)
    n_head: int = Field(default=4, ge=1, le=128)
    context: int = Field(default=128, ge=8, le=131072)
    """Tokens per training window (for ``arch = "hf"`` at most the model's
    ``max_position_embeddings``)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    vocab_size: int = Field(default=0, ge=0, le=2**32)
    """Tokens the model knows; 0 (unset): 256 for the byte model, else the tokenizer's
    (from ``data.shards``' ``meta.json``) with a preset, the config's with ``hf_config``
    or ``init_from``."""

    def __post_init__(self) -> None:
        if self.vocab_size == 1:
            raise ValueError("model.vocab_size = 1: a model needs at least 2 tokens (0: unset)")
        sources = [k for k in ("preset", "hf_config", "init_from") if getattr(self, k)]
        if self.arch == "byte":
            if sources or self.config_digest or self.init_digest:
                named = sources[0] if sources else "config_digest"
                raise ValueError(
                    f"model.{named} is for a Hugging Face model: set model.arch = 'hf'"
                )
            return
        if self.factory:
            raise ValueError("model.factory with model.arch = 'hf': use one or the other")
        # none set is refused where the model is built (node.hf): a run spec carries
        # the shared preset, or only the digest of a config file each node names
        if len(sources) > 1:
            raise ValueError(
                f"model.{sources[0]} and model.{sources[1]} both set: a model comes from one "
                "of them (init_from brings its own config.json)"
            )
        if self.init_digest and not self.init_from:
            raise ValueError("model.init_digest binds model.init_from's weights: set init_from")


@dataclass(frozen=True, config=_STRICT)
class DataConfig:
    """Text corpus: the standard library's ``.py`` files unless ``paths`` lists files or
    globs; or token shards written by ``atoll data prepare`` (``shards``), read through
    memory maps, of which this node trains on slice ``site`` of ``sites``."""

    paths: tuple[str, ...] = ()
    val_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    batch_size: int = Field(default=16, ge=1, le=4096)
    max_files: int = Field(default=0, ge=0)
    shards: str = ""
    site: int = Field(default=0, ge=0)
    sites: int = Field(default=1, ge=1, le=1_000_000)
    tokenizer_digest: str = ""
    """SHA-256 of the tokenizer the tokens were made with (``bytes`` for bytes), filled
    in at start from ``data.shards``' ``meta.json``; a run spec binds it."""

    def __post_init__(self) -> None:
        if self.site >= self.sites:
            raise ValueError(
                f"data.site = {self.site} with data.sites = {self.sites}: sites are "
                f"numbered 0 to {self.sites - 1}"
            )
        if self.shards and self.paths:
            raise ValueError("data.shards and data.paths both set: train on one or the other")


@dataclass(frozen=True, config=_STRICT)
class TrainConfig:
    """The inner loop: AdamW (or Muon, SOAP, ...) with linear warmup and cosine decay,
    gradient clipping."""

    optimizer: Literal["adamw", "adam", "sgd", "muon", "soap"] = "adamw"
    """``muon``: Muon on hidden matrices, AdamW on the rest; ``soap``: SOAP (a
    Shampoo-family preconditioner, from ``pytorch_optimizer``)."""
    lr: float = Field(default=3e-3, gt=0.0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.1, ge=0.0)
    warmup_steps: int = Field(default=50, ge=0)
    total_steps: int = Field(default=2000, ge=1)
    grad_clip: float = Field(default=1.0, ge=0.0)
    eval_batches: int = Field(default=8, ge=1)
    sharding: Literal["ddp", "fsdp"] = "ddp"
    """In a site of several processes: every rank holds the whole model (``ddp``), or
    each holds a shard of it (``fsdp``, for models that do not fit one device)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward and loss under autocast; weights, gradients, optimizer
    state, pseudo-gradients and outer steps stay float32."""
    grad_accum: int = Field(default=1, ge=1, le=4096)
    """Micro-batches of ``data.batch_size`` windows whose gradients add up to one inner
    step (a step trains on ``grad_accum * batch_size`` windows)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them:
    less memory, about a third more compute."""
    compile: bool = False
    """Compile the model with ``torch.compile`` (the first steps take longer)."""

    def __post_init__(self) -> None:
        if self.sharding == "fsdp" and self.optimizer in ("muon", "soap"):
            raise ValueError(
                f"train.optimizer = {self.optimizer!r} with train.sharding = 'fsdp': it "
                "needs whole weight matrices on each rank; use adamw, adam or sgd, or ddp"
            )


@dataclass(frozen=True, config=_STRICT)
class OuterConfig:
    """The DiLoCo outer optimizer: Nesterov SGD, lr 0.7, momentum 0.5 by default.

    DiLoCo's paper uses momentum 0.9 for runs of hundreds of outer steps; in runs of 2
    to 10 (the ``convergence`` benchmark's sweep) 0.9 overshoots in the first rounds and
    ended 1.6-11 % above momentum 0.5 at every H, which was best or within 2 % of best.
    """

    optimizer: str = "nesterov"
    lr: float = Field(default=0.7, gt=0.0)
    momentum: float = Field(default=0.5, ge=0.0, lt=1.0)
    kwargs: dict[str, float | int | bool] = Field(default_factory=dict)
    momentum_warmup: int = Field(default=0, ge=0)
    """Rounds over which the outer momentum rises linearly to ``momentum`` (round r
    uses ``momentum * min(1, r / momentum_warmup)``); 0: full momentum from the start."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """``cosine``: the outer lr decays from ``lr`` to ``lr * min_lr_ratio`` over
    ``lr_rounds`` rounds, then stays there."""
    lr_rounds: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        if self.optimizer == "nesterov" and self.momentum == 0.0:
            raise ValueError(
                "outer.momentum = 0 with outer.optimizer = 'nesterov': Nesterov needs "
                "momentum > 0; for outer steps without momentum use optimizer = 'sgd'"
            )
        if self.momentum_warmup and self.optimizer not in ("nesterov", "sgd"):
            raise ValueError(
                f"outer.momentum_warmup with outer.optimizer = {self.optimizer!r}: the "
                "warm-up applies to nesterov and sgd only"
            )
        if self.lr_schedule == "cosine" and self.lr_rounds < 1:
            raise ValueError("outer.lr_schedule = 'cosine' needs outer.lr_rounds >= 1")


@dataclass(frozen=True, config=_STRICT)
class SyncConfig:
    """How often and how fragments are synchronised."""

    trigger: Literal["seconds", "steps"] = "seconds"
    inner_steps: int = Field(default=50, ge=1)
    round_seconds: float = Field(default=30.0, gt=0.0)
    tau: int = Field(default=0, ge=0)
    alpha: float = Field(default=0.0, ge=0.0, le=1.0)
    fragments: int = Field(default=1, ge=1, le=1024)
    codec: CodecName = "none"
    block_size: int = Field(default=256, ge=1, le=2**20)
    error_feedback: bool = True
    stochastic_rounding: bool = False
    averaging: Literal["allreduce", "gossip"] = "allreduce"
    layout: Literal["butterfly", "random"] = "butterfly"
    gossip_gamma: float = Field(default=0.5, gt=0.0, le=1.0)
    mix_codec: CodecName = "fp16"

    def __post_init__(self) -> None:
        if self.stochastic_rounding and self.codec not in ("int8", "int4"):
            raise ValueError(
                f"sync.stochastic_rounding needs codec int8 or int4, not {self.codec!r}"
            )


@dataclass(frozen=True, config=_STRICT)
class NetworkConfig:
    """Where the node listens and whom it joins."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    initial_peers: tuple[str, ...] = ()
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False
    group_size: int = Field(default=4, ge=1, le=256)
    request_timeout: float = Field(default=30.0, gt=0.0)
    matchmaking_seconds: float = Field(default=3.0, gt=0.0)
    round_timeout: float = Field(default=60.0, gt=0.0)
    max_message_mb: float = Field(default=256.0, gt=0.0)
    max_tokens_per_round: int = Field(default=10**9, ge=1)
    stream_reduce: bool = False
    """An owner reduces its part block by block while the parts arrive, instead of once
    they are all in, and (for raw float32 results) streams each block of its result back
    as soon as it is reduced, ending it with a signed trailer. It hides the reduction
    behind the transfer where a core is free for it; on a machine whose cores are all
    busy during an exchange (the benchmark here: four peers on two cores) it measured
    3-24 % slower, so it is off by default."""
    min_peers: int = Field(default=1, ge=1)
    min_peers_timeout: float = Field(default=60.0, gt=0.0)
    registry_seconds: float = Field(default=2.0, gt=0.0)
    """How often a node rewrites its registry record and reads everyone's, in a swarm
    of up to ``base_rate_peers`` nodes."""
    base_rate_peers: int = Field(default=8, ge=1)
    """Swarm size up to which the registry (every ``registry_seconds``) and matchmaking
    announcements (every 0.2 s) are polled at their base rate. In a swarm of ``n`` larger
    than this both polls, and the time after which a silent peer counts as gone, stretch
    by ``n / base_rate_peers``: every read returns one record per node, so this keeps the
    bytes a node reads per second flat as the swarm grows."""
    registry_shards: int = Field(default=1, ge=1, le=4096)
    """DHT keys the registry is split over. Every node reads every record, and the few
    DHT nodes storing a key serve all of its records to every reader, so in a swarm of
    ``n`` they serve about ``n^2`` records per refresh; with ``S`` keys each key's
    holders serve ``1/S`` of that. About ``n / 256`` for a swarm of ``n`` (a node warns
    when its shards hold more than 512 records each). Must be the same on every node."""
    cells_above: int = Field(default=256, ge=2)
    """Swarm size above which matchmaking no longer reads every announcement: each node
    announces and reads only on its line of a grid (Moshpit SGD's), of ``2G`` to ``2G^2``
    peers, and groups form within lines, so what a node reads per sync stays flat as the
    swarm grows. Below it groups follow ``sync.layout`` over every announced peer
    (an exact butterfly where the swarm size allows); above it mixing is close to but not
    exactly the butterfly's."""
    join_timeout: float = Field(default=120.0, ge=0.0)
    """How long to keep trying initial peers that do not answer at start."""
    # Reaching and being reached across NAT (passed to p2pd; see README, "Across networks").
    reachability: Literal["auto", "public", "private"] = "auto"
    relay: bool = True
    auto_relay: bool = False
    trusted_relays: tuple[str, ...] = ()
    nat_port_map: bool = False
    auto_nat: bool = True
    # What one node serves at once, and how slow a sender may be (bounded memory).
    max_inbound_streams: int = Field(default=256, ge=1)
    max_inbound_per_peer: int = Field(default=32, ge=1)
    min_inbound_kib_per_second: float = Field(default=16.0, ge=0.0)
    # Parts over direct TCP between peers that can dial each other (see README, "Data plane").
    data_plane: Literal["p2pd", "tcp", "tls"] = "p2pd"
    data_port: int = Field(default=0, ge=0, le=65535)

    def __post_init__(self) -> None:
        if self.client_mode and self.reachability == "public":
            raise ValueError(
                "network.client_mode = true says peers cannot dial this node, but "
                "network.reachability = 'public' says they can: set one of them"
            )

    @field_validator("initial_peers", "announce_maddrs", "trusted_relays")
    @classmethod
    def _multiaddrs(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for maddr in value:
            if not maddr.startswith("/"):
                raise ValueError(
                    f"{maddr!r} is not a multiaddr "
                    "(expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...)"
                )
            if info.field_name != "announce_maddrs" and "/p2p/" not in maddr:
                raise ValueError(f"{maddr!r} needs its peer id: end it with /p2p/<PeerID>")
        return value


@dataclass(frozen=True, config=_STRICT)
class ControlConfig:
    """The control channel: a py-libp2p GossipSub sidecar per node.

    ``commit`` must be the same on every node of a run: with it on, a node refuses
    parts their sender did not commit to before the exchange.
    """

    enabled: bool = True
    heartbeat_seconds: float = Field(default=1.0, gt=0.0, le=60.0)
    commit: bool = True
    commit_seconds: float = Field(default=2.0, gt=0.0, le=60.0)
    dial_peers: int = Field(default=8, ge=1)
    """Peers whose sidecars a node dials (all of them in a swarm of up to this many
    others); others dial it too, so it holds about twice this many connections."""
    base_rate_peers: int = Field(default=8, ge=1)
    """Swarm size up to which heartbeats go out every ``heartbeat_seconds`` and
    commitments are also gossiped to every node. In a swarm of ``n`` larger than this
    heartbeats stretch by ``n / base_rate_peers`` (a node hears at most
    ``base_rate_peers`` heartbeats per ``heartbeat_seconds``: every message received
    costs its sidecar a few ms of CPU), and commitments go only to the members of the
    exchange's group, so what a node receives per exchange does not grow with ``n``."""
    max_message_kb: float = Field(default=256.0, gt=0.0, le=960.0)
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the control sidecar (on ``network.host``); 0 picks a free one."""
    announce_maddrs: tuple[str, ...] = ()
    """Where peers should dial the sidecar, when that differs from where it listens."""

    def __post_init__(self) -> None:
        if self.commit and not self.enabled:
            raise ValueError("control.commit needs control.enabled = true")


@dataclass(frozen=True, config=_STRICT)
class MetricsConfig:
    """The node's HTTP endpoint: Prometheus metrics at ``/metrics``, its state as JSON
    at ``/api/v1/state``. Off unless ``port`` is set (0 picks a free port, reported in
    ``status.json`` and by ``atoll status``)."""

    port: int | None = Field(default=None, ge=0, le=65535)
    host: str = "127.0.0.1"
    """Where it listens; ``0.0.0.0`` to be scraped from other machines."""


@dataclass(frozen=True, config=_STRICT)
class AtollConfig:
    """Everything one node needs to know, one nested dataclass per component."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    trust: TrustPolicy = Field(default_factory=TrustPolicy)

    def __post_init__(self) -> None:
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


def _format_error(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
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


# ---- the protocol components' settings, built from a node's config ---------------------


def transport_config(
    cfg: AtollConfig, identity_path: Path, initial_peers: tuple[str, ...]
) -> TransportConfig:
    """The transport's settings: where p2pd listens, whom it joins, NAT options."""
    from protocol.p2p.transport import TransportConfig

    net = cfg.network
    return TransportConfig(
        host=net.host,
        port=net.port,
        initial_peers=initial_peers,
        identity_path=identity_path,
        announce_maddrs=net.announce_maddrs,
        dht_client_mode=net.client_mode,
        request_timeout=net.request_timeout,
        max_message_bytes=int(net.max_message_mb * 2**20),
        # a node that says peers cannot dial it is a client for parts as well as the DHT
        reachability="private" if net.client_mode else net.reachability,
        relay=net.relay,
        auto_relay=net.auto_relay,
        trusted_relays=net.trusted_relays,
        nat_port_map=net.nat_port_map,
        auto_nat=net.auto_nat,
        max_inbound_streams=net.max_inbound_streams,
        max_inbound_per_peer=net.max_inbound_per_peer,
        min_inbound_bytes_per_second=net.min_inbound_kib_per_second * 1024,
        data_plane=net.data_plane,
        data_port=net.data_port,
    )


def allreduce_settings(cfg: AtollConfig, fragments: int) -> AllReduceSettings:
    """The all-reduce's settings for a model of ``fragments`` fragments: pseudo-gradients
    in ``sync.codec``, the global copies that groups mix in ``sync.mix_codec``."""
    from protocol.averaging.parts import AllReduceSettings

    net, sync = cfg.network, cfg.sync
    return AllReduceSettings(
        run_id=cfg.run.run_id,
        codec=sync.codec,
        block_size=sync.block_size,
        timeout=net.round_timeout,
        max_tokens=net.max_tokens_per_round,
        max_message_bytes=int(net.max_message_mb * 2**20),
        fragments=fragments,
        weights_codec=sync.mix_codec,
        stream_reduce=net.stream_reduce,
    )


def exchange_settings(cfg: AtollConfig, spec: str, fragments: int) -> ExchangeSettings:
    """How a fragment's exchange forms groups and waits for announcements."""
    from protocol.averaging.exchange import ExchangeSettings

    net = cfg.network
    return ExchangeSettings(
        run_id=cfg.run.run_id,
        spec=spec,
        fragments=fragments,
        group_size=net.group_size,
        layout=cfg.sync.layout,
        gossip=cfg.sync.averaging == "gossip",
        matchmaking_seconds=net.matchmaking_seconds,
        announce_expiration=net.round_timeout * 4,
        request_timeout=net.request_timeout,
        base_rate_peers=net.base_rate_peers,
        cells_above=net.cells_above,
    )


def clock_settings(
    cfg: AtollConfig,
    spec: str,
    fragments: int,
    initial_peers: tuple[str, ...],
    spec_t0: float | None,
) -> ClockSettings:
    """How the node agrees its round clock: whose manifests it trusts (``run.clock_signers``,
    else its initial peers), the run's round length, how long it looks for one."""
    from node.clock import ClockSettings

    net = cfg.network
    joined = {m.rpartition("/p2p/")[2] for m in initial_peers if "/p2p/" in m}
    return ClockSettings(
        run_id=cfg.run.run_id,
        spec=spec,
        round_seconds=cfg.sync.round_seconds,
        fragments=fragments,
        signers=frozenset(cfg.run.clock_signers or joined),
        spec_t0=spec_t0,
        wait=10.0 if initial_peers else 0.0,
        lead=2 * net.registry_seconds + 1,
        timeout=net.request_timeout,
    )
