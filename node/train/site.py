"""A site: one Atoll node spanning many processes (GPUs, machines) via torch.distributed.

A neocloud site trains with fast links inside and slow links to other sites. Started
under ``torchrun`` (or ``atoll run --nproc-per-node N``, which starts torchrun), a
node's ranks train data-parallel inside the site (DDP: gradients all-reduced every
inner step over the site's process group, gloo on CPU, NCCL on GPUs), each on its own
slice of the data. Only the leader (rank 0) is a node of the swarm: it holds the
identity, p2pd, the DHT and the control channel, sends the site's pseudo-gradient
(identical on every rank after DDP) and applies the swarm's results. The other ranks
(followers) do what the leader tells them, between inner steps, over the same group:

* ``PARAMS``: take the leader's parameters (after it applied a sync, re-synced or
  resumed: anything that changes the model outside an inner step);
* ``GATHER``: with ``train.sharding = "fsdp"``, hand the leader the full parameters
  (before it reads them: a sync's pseudo-gradient, a merge, a checkpoint);
* ``OPTIMIZER``: take the leader's inner optimizer state (at the start, after a resume;
  with FSDP each rank keeps the state of its own shard);
* ``STEP n``: take one inner step at schedule position ``n``;
* ``ASSIGN r``: train round ``r``'s assigned batches from now on (each rank its own
  stream, :func:`node.data.corpus.assigned_stream`, so a checker can draw them again);
* ``DIGEST``: report a digest of their parameters (the leader checks every round that
  its ranks hold the same values);
* ``STOP``: exit.

Ranks therefore stay bitwise identical (with FSDP: their shards make up one model), and
a site's tokens per step are the sum over its ranks. With FSDP the leader keeps the
node's full copy of the model in CPU memory, beside the global copy and the outer
momentum the swarm side needs anyway; the sharded model trains on the devices. If a rank dies, the leader's next collective fails and the node stops
(:class:`SiteFailed`); torchrun stops the other ranks, and the site is started again
as a whole (by its service manager), resuming from the leader's checkpoint.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "SiteFailed",
    "SiteGroup",
    "SiteRank",
    "params_digest",
    "rank_data",
    "stream_key",
]

logger = logging.getLogger(__name__)

_STEP, _PARAMS, _OPTIMIZER, _DIGEST, _STOP, _GATHER, _ASSIGN = 1, 2, 3, 4, 5, 6, 7
_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a rank waits in one collective: the leader may sit between two inner steps
while it joins the swarm or waits for peers (minutes); a dead rank is noticed at once
(its sockets close), a hung one after this."""


class SiteFailed(RuntimeError):
    """A rank of this site stopped (or the site's process group broke): the node stops."""


@dataclass(frozen=True)
class SiteRank:
    """This process's place in its site, from torchrun's environment."""

    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SiteRank | None:
        """This process's rank under torchrun; None for a node of one process."""
        env = dict(os.environ) if env is None else env
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as exc:
            raise ValueError(
                f"torchrun's RANK, WORLD_SIZE or LOCAL_RANK is not a number: {exc}"
            ) from None
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} outside WORLD_SIZE {world}")
        return cls(rank, world, local)

    def device(self, name: str) -> torch.device:
        """The device of this rank: its own GPU (``cuda:LOCAL_RANK``) or the CPU.

        Raises:
            ValueError: ``cuda:N`` (each rank takes the GPU of its local rank), or CUDA
                asked for where there is none.
        """
        if name.startswith("cuda:"):
            raise ValueError(
                f"config error: run.device = {name!r} under torchrun: each rank takes the "
                "GPU of its local rank; set run.device = 'cuda' or 'auto'"
            )
        if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError("config error: run.device = 'cuda' but no CUDA device is available")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    def slice_of(self, site: int, sites: int) -> tuple[int, int]:
        """``(index, count)`` of this rank's data slice: rank ``r`` of site ``s`` takes
        slice ``s * world + r`` of ``sites * world``."""
        return site * self.world + self.rank, sites * self.world


class SiteGroup:
    """The site's process group, and keeping its ranks in step.

    Args:
        site: this process's rank.
        device: its device (NCCL for CUDA, gloo for the CPU).
    """

    def __init__(self, site: SiteRank, device: torch.device, sharding: str = "ddp") -> None:
        if sharding not in ("ddp", "fsdp"):
            raise ValueError(f"train.sharding = {sharding!r}: expected ddp or fsdp")
        self.site = site
        self.device = device
        self.sharding = sharding
        # NCCL wants one GPU per rank; ranks sharing a GPU (a one-GPU test) use gloo
        shared = device.type == "cuda" and torch.cuda.device_count() < site.world
        backend = "nccl" if device.type == "cuda" and not shared else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=_TIMEOUT)
        self.broken = False
        self.stopped = False

    # ---- both sides ----------------------------------------------------------------------

    def agree_key(self, key: str | None) -> str:
        """The leader's key (its PeerID), known to every rank: streams are keyed by it."""
        box = [key if self.site.leader else None]
        self.guard(dist.broadcast_object_list, box, src=0)
        return str(box[0])

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp"

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the ranks train: ``model`` under DDP (which starts every rank from
        the leader's values), or ``model`` sharded in place by FSDP (each block, then
        the rest; the leader then hands out its values with :meth:`share_params`)."""
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            def shard(module: nn.Module) -> None:
                self.guard(fully_shard, module)

            for module in list(model.modules()):
                if isinstance(module, nn.ModuleList):
                    for block in module:
                        shard(block)
            shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return self.guard(DistributedDataParallel, model, device_ids=ids)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- the leader ----------------------------------------------------------------------

    def step(self, steps: int) -> None:
        """Before each inner step: every rank steps at schedule position ``steps``."""
        self._order(_STEP, steps)

    def assign(self, round_: int) -> None:
        """Every follower trains round ``round_``'s assigned stream from now on."""
        self._order(_ASSIGN, round_)

    def share_params(self, model: nn.Module, trained: nn.Module) -> None:
        """Every rank takes the leader's parameters (and buffers) of ``model`` into the
        module it trains (``trained``: ``model`` itself under DDP, its shards under FSDP)."""
        self._order(_PARAMS)
        self._take_params(trained, model)

    def gather(self, model: nn.Module, trained: nn.Module) -> None:
        """Under FSDP: the leader's ``model`` takes the full values of the shards the
        ranks trained (nothing to do under DDP: the leader trains ``model`` itself)."""
        if not self.sharded:
            return
        self._order(_GATHER)
        with torch.no_grad():
            for full, shard in zip(model.parameters(), trained.parameters()):
                full.copy_(self.guard(shard.full_tensor))

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes the leader's inner optimizer state (under DDP; under FSDP
        each rank's state is of its own shard)."""
        if self.sharded:
            return
        self._order(_OPTIMIZER)
        state = _to_cpu(optimizer.state_dict())
        self.guard(dist.broadcast_object_list, [state], src=0)

    def digests(self, trained: nn.Module) -> list[str]:
        """Every rank's digest of the parameters it trains (the full values, under
        FSDP), by rank, the leader's first."""
        self._order(_DIGEST)
        gathered: list[Any] = [None] * self.site.world
        self.guard(dist.gather_object, self._digest(trained), gathered, dst=0)
        return [str(d) for d in gathered]

    def stop(self) -> None:
        """Tell the followers to exit (once; not over a broken group), and take the
        process group down with them: every rank passes one barrier, then all close."""
        if self.stopped or self.broken:
            return
        self.stopped = True
        self._order(_STOP)
        self.guard(dist.barrier)
        self.close()

    def _order(self, op: int, arg: int = 0) -> None:
        order = torch.tensor([op, arg], dtype=torch.int64, device=self.device)
        self.guard(dist.broadcast, order, src=0)

    # ---- a follower ----------------------------------------------------------------------

    def follow(
        self, model: nn.Module, trainer: Any, assigned: Callable[[int], Any] | None = None
    ) -> int:
        """Do what the leader says until it says stop; returns the inner steps taken.

        Args:
            assigned: this rank's assigned stream of a round (for ``ASSIGN``).
        """
        taken = 0
        order = torch.zeros(2, dtype=torch.int64, device=self.device)
        while True:
            self.guard(dist.broadcast, order, src=0)
            op, arg = int(order[0]), int(order[1])
            if op == _STEP:
                trainer.steps = arg  # the leader's place in the learning-rate schedule
                self.guard(trainer.step)
                taken += 1
            elif op == _PARAMS:
                self._take_params(model)
            elif op == _GATHER:
                for shard in model.parameters():
                    self.guard(shard.full_tensor)
            elif op == _OPTIMIZER:
                box: list[Any] = [None]
                self.guard(dist.broadcast_object_list, box, src=0)
                trainer.optimizer.load_state_dict(box[0])
            elif op == _DIGEST:
                self.guard(dist.gather_object, self._digest(model), None, dst=0)
            elif op == _ASSIGN and assigned is not None:
                trainer.draw_from(assigned(arg))
            elif op == _STOP:
                self.guard(dist.barrier)
                return taken
            else:
                raise SiteFailed(f"unknown order {op} from the site's leader")

    # ---- helpers -------------------------------------------------------------------------

    def _take_params(self, trained: nn.Module, source: nn.Module | None = None) -> None:
        """Every rank's ``trained`` takes the leader's values (from ``source`` on the
        leader, ``trained`` itself under DDP)."""
        source = trained if source is None else source
        with torch.no_grad():
            if not self.sharded:
                for t in [*trained.parameters(), *trained.buffers()]:
                    self.guard(dist.broadcast, t.data, src=0)
                return
            from torch.distributed.tensor import distribute_tensor

            for shard, full in zip(trained.parameters(), source.parameters()):
                # rank 0's values are scattered: each rank keeps its own shard
                values = full.detach() if self.site.leader else torch.empty(shard.shape)
                mine = self.guard(
                    distribute_tensor,
                    values.to(self.device, torch.float32),
                    shard.device_mesh,
                    shard.placements,
                )
                shard.copy_(mine)
            for t in trained.buffers():
                self.guard(dist.broadcast, t.data, src=0)

    def _digest(self, trained: nn.Module) -> str:
        if not self.sharded:
            return params_digest(trained)
        h = hashlib.sha256()
        for shard in trained.parameters():
            full = self.guard(shard.full_tensor)
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a collective (or an inner step, whose backward pass
        all-reduces over the site): its failure is a :class:`SiteFailed`."""
        if self.broken:
            raise SiteFailed("the site's process group broke earlier")
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ConnectionError) as exc:
            self.broken = True
            raise SiteFailed(
                f"rank {self.site.rank} of {self.site.world}: a rank of this site stopped "
                f"or cannot be reached ({str(exc).splitlines()[0] if str(exc) else exc!r})"
            ) from exc


def params_digest(model: nn.Module) -> str:
    """SHA-256 over a model's parameters and buffers, in order (ranks compare it)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            h.update(t.detach().to("cpu", copy=True).contiguous().numpy().tobytes())
    return h.hexdigest()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def rank_data(cfg: Any, train: torch.Tensor, site: SiteRank | None) -> torch.Tensor:
    """This process's slice of the train tokens: slice ``data.site`` of ``data.sites``,
    and within it this rank's share (:meth:`SiteRank.slice_of`); a view, nothing read."""
    from node.data.corpus import site_slice

    index, count = cfg.data.site, cfg.data.sites
    if site is not None:
        index, count = site.slice_of(cfg.data.site, cfg.data.sites)
    return site_slice(train, index, count, cfg.model.context)


def stream_key(key: str, site: SiteRank | None) -> object:
    """What keys this process's batch stream: the node's PeerID, and its rank in a site."""
    return key if site is None else (key, site.rank)
