"""The DiLoCo outer step, per fragment, and when each fragment syncs.

Each node keeps a *global* copy of every fragment (the value the swarm agreed on at
the last sync) beside its *local* copy (what its inner optimizer trains). At a sync
point the fragment's pseudo-gradient ``global - local`` is averaged across peers, the
outer optimizer (Nesterov SGD, lr 0.7 as in Douillard et al., "DiLoCo",
2023) steps the global copy with the average as its gradient, and the local copy is
reset to the new global value.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from node.config import OuterConfig
from protocol.averaging.fragments import FragmentPlan
from protocol.catchup import StateSnapshot

__all__ = ["OuterOptimizer", "make_outer_optimizer", "sync_schedule"]


def make_outer_optimizer(params: list[torch.Tensor], cfg: OuterConfig) -> torch.optim.Optimizer:
    """Build the configured outer optimizer over ``params``.

    ``nesterov`` and ``sgd`` are SGD with momentum (with and without Nesterov);
    any other name is looked up in :mod:`torch.optim` (``"Adam"`` or
    ``"torch.optim.Adam"``) and given ``lr`` plus ``outer.kwargs``.

    Raises:
        ValueError: an unknown optimizer name or arguments it does not accept.
    """
    name = cfg.optimizer
    if name == "nesterov":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    attr = name.removeprefix("torch.optim.")
    factory: Callable[..., Any] | None = getattr(torch.optim, attr, None)
    if not (isinstance(factory, type) and issubclass(factory, torch.optim.Optimizer)):
        raise ValueError(
            f"config error: outer.optimizer = {name!r}: expected nesterov, sgd or a "
            "torch.optim class name such as Adam"
        )
    try:
        return factory(params, lr=cfg.lr, **cfg.kwargs)
    except TypeError as exc:
        raise ValueError(f"config error: outer.kwargs for {name}: {exc}") from None


def sync_schedule(inner_steps: int, fragments: int) -> dict[int, list[int]]:
    """Which fragments sync after which inner step of a round (1-based steps).

    Fragments are staggered evenly across the round so the link carries a steady
    stream: fragment ``f`` syncs after step ``ceil((f + 1) * H / F)``. Every fragment
    syncs exactly once per round, the last one after step ``H``.
    """
    if inner_steps < 1 or fragments < 1:
        raise ValueError("inner_steps and fragments must be >= 1")
    out: dict[int, list[int]] = {}
    for f in range(fragments):
        step = -(-(f + 1) * inner_steps // fragments)
        out.setdefault(step, []).append(f)
    return out


class OuterOptimizer:
    """Global copies of every fragment and one outer optimizer per fragment.

    The outer state (global copies, outer momentum) is float32 in CPU memory whatever
    device trains: beside a GPU's model it stays off the GPU, in pinned (page-locked)
    memory with ``pin``, so copies between it and the device run at full speed.

    Args:
        model: the local model; its current values become the initial global values.
        plan: the fragment plan of ``model``.
        cfg: outer optimizer settings.
        pin: keep the outer state in pinned memory (needs CUDA).
    """

    def __init__(
        self, model: nn.Module, plan: FragmentPlan, cfg: OuterConfig, pin: bool = False
    ) -> None:
        self.plan = plan
        self.cfg = cfg
        self.pin = pin
        params = dict(model.named_parameters())
        self.globals = [
            nn.Parameter(self._pinned(plan.flatten(params, f)), requires_grad=True)
            for f in range(len(plan))
        ]
        self.optimizers = [make_outer_optimizer([g], cfg) for g in self.globals]
        self._pin_state()

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.pin and not t.is_pinned() else t

    def _pin_state(self) -> None:
        """Momentum buffers in pinned memory too, made before the first step where the
        optimizer would make them itself (SGD's first step sets the buffer to the
        gradient, as a zero buffer stepped once does)."""
        if not self.pin:
            return
        for g, opt in zip(self.globals, self.optimizers):
            state = opt.state[g]
            if isinstance(opt, torch.optim.SGD) and opt.defaults.get("momentum"):
                buf = state.get("momentum_buffer")
                state["momentum_buffer"] = (
                    self._pinned(buf) if buf is not None else self._pinned(torch.zeros_like(g))
                )
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.numel() == g.numel():
                    state[key] = self._pinned(value)

    def local_vector(self, model: nn.Module, fragment: int) -> torch.Tensor:
        """A copy of the fragment's local values, flat."""
        return self.plan.flatten(dict(model.named_parameters()), fragment).detach().clone()

    def pseudo_gradient(self, model: nn.Module, fragment: int) -> torch.Tensor:
        """``global - local`` for one fragment, as a flat float32 vector."""
        local = self.plan.flatten(dict(model.named_parameters()), fragment)
        return self.globals[fragment].detach() - local

    def schedule(self, round_: int) -> tuple[float, float | None]:
        """The outer lr and momentum of round ``round_`` (1-based): a function of the
        round alone, so every member of a group steps the same way, whenever it joined.
        Momentum is None for optimizers that have none to warm up."""
        cfg = self.cfg
        lr = cfg.lr
        if cfg.lr_schedule == "cosine":
            progress = min(1.0, max(0, round_ - 1) / cfg.lr_rounds)
            floor = cfg.lr * cfg.min_lr_ratio
            lr = floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        momentum = None
        if cfg.optimizer in ("nesterov", "sgd"):
            momentum = cfg.momentum
            if cfg.momentum_warmup:
                momentum *= min(1.0, max(1, round_) / cfg.momentum_warmup)
        return lr, momentum

    def step_scale(self, round_: int) -> float:
        """How far round ``round_``'s outer step moves a fragment per unit of averaged
        pseudo-gradient, leaving out the momentum buffer (each member's own): the
        learning rate, times one plus the momentum for Nesterov. The same on every node.
        Other optimizers scale their steps by state of their own: the learning rate."""
        lr, momentum = self.schedule(round_)
        if self.cfg.optimizer == "nesterov" and momentum is not None:
            return lr * (1.0 + momentum)
        return lr

    def step(
        self, fragment: int, averaged: torch.Tensor, round_: int | None = None
    ) -> torch.Tensor:
        """Apply the outer optimizer to a fragment's global copy; return the new value.

        Args:
            round_: the round this step belongs to, for the outer schedule
                (:meth:`schedule`); None steps with the optimizer's settings as they are.
        """
        g = self.globals[fragment]
        if averaged.shape != g.shape:
            raise ValueError(
                f"fragment {fragment}: averaged pseudo-gradient has shape "
                f"{tuple(averaged.shape)}, expected {tuple(g.shape)}"
            )
        if not torch.isfinite(averaged).all():
            raise ValueError(f"fragment {fragment}: averaged pseudo-gradient is not finite")
        g.grad = averaged.to(g.dtype).clone()
        if round_ is not None:
            lr, momentum = self.schedule(round_)
            for group in self.optimizers[fragment].param_groups:
                group["lr"] = lr
                if momentum is not None:
                    group["momentum"] = momentum
        self.optimizers[fragment].step()
        self.optimizers[fragment].zero_grad(set_to_none=True)
        return g.detach()

    def step_mixed(
        self,
        fragment: int,
        averaged: torch.Tensor,
        own: torch.Tensor,
        mean: torch.Tensor,
        gossip_pull: float | None = None,
        round_: int | None = None,
    ) -> torch.Tensor:
        """Outer step of a group that does not span the swarm (see :mod:`node.run.syncer`).

        Args:
            averaged: the group's mean pseudo-gradient.
            own: this node's global copy as it sent it to the group.
            mean: the group's mean global copy.
            gossip_pull: ``gamma / lr`` for NoLoCo's gossip step, which adds
                ``gossip_pull * (own - mean)`` to the gradient so the pull towards the
                partner runs through the outer momentum; None adopts the group's mean
                copy and then steps it (Moshpit SGD's group averaging).
        """
        own = own.to(mean.device)
        if gossip_pull is not None:
            return self.step(fragment, averaged + gossip_pull * (own - mean), round_)
        self.set_global(fragment, mean)
        return self.step(fragment, averaged, round_)

    def sync_local(self, model: nn.Module, fragment: int) -> None:
        """Reset the local copy of a fragment to its global value."""
        self.plan.write(dict(model.named_parameters()), fragment, self.globals[fragment].detach())

    def merge_local(
        self,
        model: nn.Module,
        fragment: int,
        alpha: float,
        sent_from: torch.Tensor | None = None,
    ) -> None:
        """Merge the new global value into the local copy.

        ``local = alpha * local + (1 - alpha) * (global + overlap)``, as in Streaming
        DiLoCo (Douillard et al., 2025) with ``overlap`` the inner steps taken since the
        sync was launched (``local - sent_from``, ``sent_from`` being the local copy the
        pseudo-gradient was computed from): that work is not in the global value yet,
        so it is kept and goes into the next sync instead of being thrown away while a
        slow exchange runs. Without overlap (``sent_from`` None, or no step since) and
        ``alpha = 0`` this is plain DiLoCo: local := global.
        """
        params = dict(model.named_parameters())
        target = self.globals[fragment].detach()
        if sent_from is not None or alpha != 0.0:
            local = self.plan.flatten(params, fragment)
            if sent_from is not None:
                target = target + (local - sent_from.to(local.device))
            if alpha != 0.0:
                target = alpha * local + (1.0 - alpha) * target
        self.plan.write(params, fragment, target)

    def rebase_local(self, model: nn.Module, fragment: int, before: torch.Tensor) -> None:
        """Move the local copy by as much as the global copy moved since ``before``,
        keeping the local work not yet contributed (a re-sync from the swarm)."""
        params = dict(model.named_parameters())
        local = self.plan.flatten(params, fragment)
        self.plan.write(params, fragment, local + self.globals[fragment].detach() - before)

    def global_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's global value by name, as views of the global copies (for
        evaluating them without a second model: :func:`node.train.trainer.evaluate`)."""
        out: dict[str, torch.Tensor] = {}
        for f, g in enumerate(self.globals):
            out.update(self.plan.views(g.detach(), f))
        return out

    def write_globals(self, model: nn.Module) -> None:
        """Load every fragment's global value into ``model`` (e.g. to evaluate it)."""
        params = dict(model.named_parameters())
        for f, g in enumerate(self.globals):
            self.plan.write(params, f, g.detach())

    def apply(
        self, model: nn.Module, fragment: int, averaged: torch.Tensor, round_: int | None = None
    ) -> None:
        """Outer step on the global copy, then local := global."""
        self.step(fragment, averaged, round_)
        self.sync_local(model, fragment)

    def global_vector(self, fragment: int) -> torch.Tensor:
        return self.globals[fragment].detach().clone()

    def set_global(self, fragment: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.globals[fragment].copy_(value)

    def snapshot(
        self, round_: int, plan_digest: str, steps: int = 0, copy_tensors: bool = True
    ) -> StateSnapshot:
        """The global state now, to serve to peers; ``copy_tensors=False`` refers to the
        live tensors (for :meth:`protocol.stateserver.StateServer.publish` at once, which
        copies them into its replies)."""

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if copy_tensors else t.detach()

        momentum = []
        for opt in self.optimizers:
            buf = next(iter(opt.state.values()), {}).get("momentum_buffer")
            momentum.append(None if buf is None else own(buf))
        return StateSnapshot(
            round=round_,
            plan_digest=plan_digest,
            globals=tuple(own(g) for g in self.globals),
            momentum=tuple(momentum),
            steps=steps,
        )

    def load_snapshot(self, snap: StateSnapshot) -> None:
        """Load a peer's state: globals and momentum. A fragment the snapshot holds no
        momentum for (its holder never stepped it) drops this node's own, so both apply
        the next outer step alike."""
        for f, value in enumerate(snap.globals):
            self.set_global(f, value)
            buf = snap.momentum[f]
            state = self.optimizers[f].state[self.globals[f]]
            if buf is not None:
                state["momentum_buffer"] = buf.clone()
            elif state.get("momentum_buffer") is not None:
                state["momentum_buffer"].zero_()  # stepped from zero: as from none, bitwise

    def state_dict(self, copy_tensors: bool = True) -> dict[str, Any]:
        """Global copies and optimizer states; ``copy_tensors=False`` hands out the live
        tensors (for a checkpoint written before anything steps again: no second copy
        of the outer state in memory)."""
        if not copy_tensors:
            return {
                "globals": [g.detach() for g in self.globals],
                "optimizers": [o.state_dict() for o in self.optimizers],
            }
        return {
            "globals": [g.detach().clone() for g in self.globals],
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        globals_ = state["globals"]
        if len(globals_) != len(self.globals):
            raise ValueError("checkpoint has a different number of fragments")
        for g, value in zip(self.globals, globals_):
            if value.shape != g.shape:
                raise ValueError("checkpoint fragment shape does not match the model")
            with torch.no_grad():
                g.copy_(value)
        for opt, st in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(st)
        self._pin_state()
