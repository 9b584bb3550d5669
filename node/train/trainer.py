"""The inner loop: local optimizer steps on this node's data, and evaluation.

Read top to bottom: :meth:`InnerTrainer.step` takes ``train.grad_accum`` batches,
computes the next-token cross-entropy of each (under bf16 autocast with
``train.precision = "bf16"``) and adds up their gradients, clips the gradient, and
steps AdamW at the learning rate of a linear-warmup + cosine schedule. :func:`evaluate`
reports bits per byte of text on fixed validation batches, always in float32 so that
every node's figures compare.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from node.config import TrainConfig
from node.data.corpus import BatchStream, bits_per_byte
from node.train.model import enable_activation_checkpointing

__all__ = [
    "InnerTrainer",
    "OptimizerSet",
    "StepResult",
    "evaluate",
    "lr_at",
    "make_inner_optimizer",
    "mean_loss",
    "replay_step",
    "window_losses",
]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate after ``step`` completed steps: linear warmup, then cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


_BETAS = (0.9, 0.95)
_NOT_HIDDEN = ("tok", "pos", "embed", "wte", "wpe", "head")
"""Names of 2-D parameters that are not hidden weight matrices (embeddings, the output
layer): Muon leaves them to AdamW, as its authors do."""


class OptimizerSet:
    """Several optimizers stepped as one (Muon for the hidden matrices, AdamW for the
    rest): the trainer sets ``lr`` on every group, checkpoints hold each one's state."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            raise ValueError("inner optimizer state is not this optimizer's (train.optimizer)")
        for o, part in zip(self.optimizers, parts):
            o.load_state_dict(part)


def make_inner_optimizer(
    model: nn.Module, cfg: TrainConfig
) -> torch.optim.Optimizer | OptimizerSet:
    """The inner optimizer ``train.optimizer`` names; no weight decay on 1-D parameters
    (biases, norms).

    * ``adamw`` (default), ``adam``, ``sgd`` (momentum 0.9): from ``torch.optim``;
    * ``muon``: ``torch.optim.Muon`` (Newton-Schulz orthogonalised momentum) on the
      hidden weight matrices, its step scaled to AdamW's RMS so ``train.lr`` means the
      same; AdamW on embeddings, the output layer and 1-D parameters;
    * ``soap``: SOAP (Shampoo's preconditioner with Adam run in its eigenbasis, Vyas et
      al. 2024) from ``pytorch_optimizer``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=_BETAS)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=_BETAS)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "soap":
        from pytorch_optimizer import SOAP

        return SOAP(groups, lr=cfg.lr, betas=_BETAS)
    hidden = [p for n, p in named if p.dim() == 2 and not _not_hidden(n)]
    ids = {id(p) for p in hidden}
    rest_decay = [p for n, p in named if p.dim() >= 2 and id(p) not in ids]
    muon = torch.optim.Muon(
        hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        [
            {"params": rest_decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=_BETAS,
    )
    return OptimizerSet([muon, adamw])


def _not_hidden(name: str) -> bool:
    parts = name.replace("module.", "").split(".")
    return any(part.startswith(_NOT_HIDDEN) for part in parts)


@dataclass(frozen=True)
class StepResult:
    """What one inner step did."""

    loss: float
    tokens: int
    lr: float


class InnerTrainer:
    """Local training of one model copy.

    Args:
        model: the local model (its parameters are trained in place).
        cfg: inner-loop settings.
        stream: this node's training batches.
        device: where to compute.
        ranks: processes training in step on batches of the same size (a site under
            torch.distributed): the tokens counted per step are this many batches'.

    Raises:
        ValueError: ``train.activation_checkpointing`` for a model without it.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        stream: BatchStream,
        device: torch.device | str = "cpu",
        ranks: int = 1,
    ) -> None:
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(getattr(model, "module", model))  # DDP's inside
        if cfg.compile:
            model.compile()  # in place: parameter names and the optimizer's view unchanged
        self.model = model
        self.ranks = ranks
        self.cfg = cfg
        self.stream = stream
        self.device = torch.device(device)
        self.optimizer = make_inner_optimizer(model, cfg)
        self.bf16 = cfg.precision == "bf16"
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        """Wall time spent in inner steps (what checks beside training are paced by)."""

    def draw_from(self, stream: BatchStream) -> None:
        """Train on ``stream``'s batches from the next step on (a round's assignment)."""
        self.stream = stream

    def step(self) -> StepResult:
        """One optimizer step on the next ``train.grad_accum`` batches."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.seconds += time.perf_counter() - started

    def _step(self) -> StepResult:
        lr = lr_at(self.steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        accum = self.cfg.grad_accum
        total = torch.zeros((), device=self.device)
        tokens = 0
        for micro in range(accum):
            inputs, targets = self.stream.next()
            # under DDP only the last micro-batch's backward all-reduces the gradients
            last = micro == accum - 1
            sync = (
                contextlib.nullcontext()
                if last or not hasattr(self.model, "no_sync")
                else self.model.no_sync()
            )
            with sync:
                total += _backward(self.model, inputs, targets, accum, self.bf16, self.device)
            tokens += targets.numel()
        _optimizer_step(self.model, self.optimizer, self.cfg)
        self.steps += 1
        tokens *= self.ranks
        self.tokens += tokens
        return StepResult(loss=float(total) / accum, tokens=tokens, lr=lr)


def _backward(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    share: int,
    bf16: bool,
    device: torch.device,
) -> torch.Tensor:
    """One micro-batch's next-token loss, its gradient added at weight ``1 / share``;
    the loss, detached. bf16: forward and loss under autocast; the weights, their
    gradients and the optimizer state stay float32 (the master copy)."""
    inputs, targets = inputs.to(device), targets.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    (loss / share if share > 1 else loss).backward()
    return loss.detach()


def _optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerSet, cfg: TrainConfig
) -> None:
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()


def replay_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerSet,
    cfg: TrainConfig,
    batches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    lr: float,
    device: torch.device | str = "cpu",
) -> float:
    """One inner step trained again, as :meth:`InnerTrainer.step` trained it, in one
    process: ``batches[rank]`` are each rank's ``train.grad_accum`` micro-batches (a
    site's ranks average their gradients, as DDP does). Returns rank 0's mean loss (what
    the site's leader recorded)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = torch.device(device)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    share = sum(len(b) for b in batches)
    bf16 = cfg.precision == "bf16"
    first = torch.zeros((), device=device)
    for rank, micro in enumerate(batches):
        for inputs, targets in micro:
            loss = _backward(model, inputs, targets, share, bf16, device)
            if rank == 0:
                first += loss
    _optimizer_step(model, optimizer, cfg)
    return float(first) / max(1, len(batches[0]))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str = "cpu",
    bytes_per_token: float = 1.0,
    params: dict[str, torch.Tensor] | None = None,
) -> float:
    """Mean validation loss over ``batches``, in bits per byte of text (``bytes_per_token``:
    the text a token stands for, from the shards' ``meta.json``; 1 for bytes).

    Args:
        params: values to evaluate ``model`` at instead of its own (by name, e.g. views
            of the global copies: :meth:`node.train.outer.OuterOptimizer.global_params`), so
            no second copy of the model is needed.
    """
    return bits_per_byte(mean_loss(model, batches, device, params), bytes_per_token)


@torch.no_grad()
def mean_loss(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str = "cpu",
    params: dict[str, torch.Tensor] | None = None,
) -> float:
    """Mean cross-entropy over ``batches`` in nats per token: a forward in eval mode,
    each batch's sum in float32, the total in float64 (``params`` as for
    :func:`evaluate`)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    if params is not None:
        params = {k: v.to(device) for k, v in params.items()}
    for inputs, targets in batches:
        if params is None:
            logits = model(inputs.to(device))
        else:
            logits = torch.func.functional_call(model, params, (inputs.to(device),))
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.to(device).reshape(-1),
            reduction="sum",
        )
        total += float(loss)
        count += targets.numel()
    model.train(was_training)
    return total / max(1, count)


@torch.no_grad()
def window_losses(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    params: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
) -> list[float]:
    """Each window's mean cross-entropy in nats per token, at ``params``: one forward of
    the ``(W, T)`` windows in eval mode, each window's sum in float64 (as
    :func:`mean_loss` sums a batch), so two nodes evaluating the same windows in the same
    order agree to about 1e-6 relative."""
    was_training = model.training
    model.eval()
    params = {k: v.to(device) for k, v in params.items()}
    logits = torch.func.functional_call(model, params, (inputs.to(device),))
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.to(device).reshape(-1),
        reduction="none",
    )
    model.train(was_training)
    per_window = loss.view(targets.shape).double().sum(1) / targets.shape[1]
    return [float(v) for v in per_window.cpu()]
