"""The sections of a node's configuration that say what it trains and where it keeps it.

``[run]``, ``[model]``, ``[data]``, ``[train]`` and ``[outer]``: frozen pydantic
dataclasses that :mod:`node.config` nests into :class:`~node.config.AtollConfig` (and
re-exports). Every key carries its description as the string literal after it, which
the configuration reference is generated from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

__all__ = ["DataConfig", "ModelConfig", "OuterConfig", "RunConfig", "TrainConfig"]

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class RunConfig:
    """Identity of the run and where a node keeps its files."""

    run_id: str = Field(default="atoll-demo", min_length=1, max_length=64)
    """The run's name (1 to 64 characters): every signed message, DHT key and control
    topic carries it, and messages of other runs are refused. Shared by every node."""
    seed: int = 0
    """Seeds the model's first weights and each node's stream of training windows (with
    its PeerID), so a run can be repeated. Shared by every node."""
    data_dir: str = ".atoll/node"
    """Where the node keeps its identity key, checkpoints, state files, audit database,
    event log and ``status.json`` (``--data-dir`` sets it too)."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    threads: int = Field(default=0, ge=0)
    """Threads torch may use for this node's compute (``torch.set_num_threads``); 0 leaves
    torch's default."""
    max_rounds: int = Field(default=0, ge=0)
    """The run's round after which the node stops (and stays reachable a moment for peers
    that still need it); 0 runs until it is stopped. A round of the run, not a count of
    this node's rounds: a node restarted or joining later stops at the same round, and
    one that starts at or past it stops at once with an error."""
    slowdown: float = Field(default=1.0, ge=1.0)
    """Stretch every inner step to this many times its time (sleeping the rest), so a node
    stands in for a slower machine in tests and benchmarks; 1 runs at full speed."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Rounds between two checkpoints in ``data_dir``'s ``checkpoints`` (1: after every
    round)."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """How many of the newest checkpoints are kept; older ones are removed."""
    eval_every: int = Field(default=1, ge=1)
    """Rounds between two evaluations of the global model on the validation batches (1:
    after every round)."""
    clock_signers: tuple[str, ...] = ()
    """Without a run spec: the PeerIDs whose round-clock manifests this node takes
    (empty: the nodes it joins through, its initial peers)."""
    spec_signers: tuple[str, ...] = ()
    """PeerIDs besides its creator that may sign the next version of this run's spec
    (``atoll spec create --previous``): a new key for the operator, or a co-operator.
    Shared by every node (the spec that names them is signed)."""

    @field_validator("clock_signers", "spec_signers")
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
    """``byte``: the reference byte-level GPT (or ``factory``'s model); ``hf``: a Hugging
    Face causal LM from ``preset``, ``hf_config`` or ``init_from``."""
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
    """``package.module:function`` returning any ``nn.Module`` that maps ``(B, T)`` tokens
    to ``(B, T, vocab_size)`` logits, in place of the byte-level GPT; empty: not used."""
    n_layer: int = Field(default=2, ge=1, le=64)
    """Transformer blocks of the byte-level GPT (1 to 64)."""
    n_embd: int = Field(default=128, ge=8, le=8192)
    """Width of the byte-level GPT's embeddings and blocks (8 to 8192), split evenly
    over ``n_head`` heads."""
    n_head: int = Field(default=4, ge=1, le=128)
    """Attention heads per block of the byte-level GPT (1 to 128)."""
    context: int = Field(default=128, ge=8, le=131072)
    """Tokens per training window (for ``arch = "hf"`` at most the model's
    ``max_position_embeddings``)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability in the byte-level GPT while training, in ``[0, 1)``."""
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
        # none set is refused where the model is built (node.train.hf): a run spec carries
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
    """Text files or globs to train on, split into train and validation by a hash of
    each file's path; empty: the running Python's standard library ``.py`` files."""
    val_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Share of the corpus held out for validation (chosen by file), in ``(0, 1)``."""
    batch_size: int = Field(default=16, ge=1, le=4096)
    """Windows of ``model.context`` tokens per micro-batch (1 to 4096)."""
    max_files: int = Field(default=0, ge=0)
    """Use at most the first this many of the files found; 0: all of them."""
    shards: str = ""
    """A directory of token shards written by ``atoll data prepare`` (``train.bin``,
    ``val.bin``, ``meta.json``), read through memory maps; empty: train on ``paths``."""
    site: int = Field(default=0, ge=0)
    """Which slice of the train tokens this node trains on, from 0 to ``sites - 1``."""
    sites: int = Field(default=1, ge=1, le=1_000_000)
    """Disjoint slices the train tokens are cut into (1: this node takes them all)."""
    tokenizer_digest: str = ""
    """SHA-256 of the tokenizer the tokens were made with (``bytes`` for bytes), filled
    in at start from ``data.shards``' ``meta.json``; a run spec binds it."""
    dataset_digest: str = ""
    """SHA-256 of the train and validation tokens this node reads (``data.shards``' token
    files, or the text files of ``data.paths`` or the standard library), filled in at
    start; a run spec binds it."""

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
    """Peak learning rate of the inner optimizer, reached after ``warmup_steps``."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Where the cosine decay ends, as a fraction of ``lr`` (0 to 1)."""
    weight_decay: float = Field(default=0.1, ge=0.0)
    """Weight decay of the inner optimizer on weight matrices (none on biases and norms)."""
    warmup_steps: int = Field(default=50, ge=0)
    """Inner steps over which the learning rate rises linearly from 0 to ``lr``."""
    total_steps: int = Field(default=2000, ge=1)
    """Inner steps over which the learning rate decays by a cosine to ``lr *
    min_lr_ratio``, where it then stays."""
    grad_clip: float = Field(default=1.0, ge=0.0)
    """Largest global gradient norm of an inner step (larger ones are scaled down to it);
    0 turns clipping off."""
    eval_batches: int = Field(default=8, ge=1)
    """Fixed validation batches each evaluation averages the loss over."""
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
    """``nesterov`` (SGD with Nesterov momentum), ``sgd`` or the name of any
    ``torch.optim`` class, stepping each fragment's global copy with the mean
    pseudo-gradient."""
    lr: float = Field(default=0.7, gt=0.0)
    """Learning rate of the outer step (DiLoCo's 0.7)."""
    momentum: float = Field(default=0.5, ge=0.0, lt=1.0)
    """Momentum of ``nesterov`` and ``sgd``, in ``[0, 1)`` (``nesterov`` needs more
    than 0)."""
    kwargs: dict[str, float | int | bool] = Field(default_factory=dict)
    """Keyword arguments besides ``lr`` of an outer optimizer named by its ``torch.optim``
    class (e.g. ``betas`` of ``Adam``); unused by ``nesterov`` and ``sgd``."""
    momentum_warmup: int = Field(default=0, ge=0)
    """Rounds over which the outer momentum rises linearly to ``momentum`` (round r
    uses ``momentum * min(1, r / momentum_warmup)``); 0: full momentum from the start."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """``cosine``: the outer lr decays from ``lr`` to ``lr * min_lr_ratio`` over
    ``lr_rounds`` rounds, then stays there."""
    lr_rounds: int = Field(default=0, ge=0)
    """Rounds of the ``cosine`` outer schedule (at least 1 with it); unused by
    ``constant``."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Where the ``cosine`` outer schedule ends, as a fraction of ``lr`` (0 to 1)."""

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
