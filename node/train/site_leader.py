"""The leader's side of a site as the node's training sees it (:class:`SiteLeader`), and
a node without one (:class:`NoSite`), behind one interface: inner steps on every rank,
the ranks given the leader's parameters when they changed outside an inner step, the
shards gathered under FSDP before the model is read, and the ranks' digests compared
(the process group and its orders are :mod:`node.train.site`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from node.train.site import SiteGroup, params_digest

__all__ = ["NoSite", "SiteLeader"]


class SiteLeader:
    """The leader's side of a site, as the node's training sees it: the ranks take its
    parameters when they changed outside an inner step, and under FSDP it gathers the
    full values of the shards before it reads its model.

    Args:
        group: the site's process group.
        model: the node's full model (the leader's copy; in CPU memory under FSDP).
        trained: what the ranks train: ``model`` itself under DDP, its shards under FSDP.
    """

    def __init__(self, group: SiteGroup, model: nn.Module, trained: nn.Module) -> None:
        self.group = group
        self.model = model
        self.trained = trained
        self.changed = True  # the model changed outside an inner step: the ranks take it
        self.ahead = False  # under FSDP: the shards trained past self.model

    @property
    def sharded(self) -> bool:
        return self.group.sharded

    def step(self, trainer: Any) -> Any:
        """One inner step on every rank (DDP all-reduces in it); the trainer's result."""
        self.share()
        self.group.step(trainer.steps)
        result = self.group.guard(trainer.step)
        self.ahead = self.group.sharded
        return result

    def model_changed(self) -> None:
        """The model changed outside an inner step (a sync applied, a re-sync, a
        catch-up): the ranks take it before the next one."""
        self.changed = True

    def share(self) -> None:
        """The ranks take the leader's parameters if they changed since the last inner
        step (a sync applied, a re-sync, a catch-up)."""
        if self.changed:
            self.group.share_params(self.model, self.trained)
            self.changed = False

    def pull(self, stopping: bool) -> None:
        """Under FSDP, before the node reads its model: the full values of the shards.
        Not while ``stopping`` (torchrun is stopping the ranks: nothing to gather from)."""
        if not self.ahead or stopping:
            return
        if not (self.group.stopped or self.group.broken):
            self.group.gather(self.model, self.trained)
            self.ahead = False

    def assign(self, round_: int) -> None:
        """Every follower trains round ``round_``'s assigned stream from now on (the
        leader switches its own)."""
        self.group.assign(round_)

    def agree(self) -> tuple[int, bool]:
        """How many ranks there are, and whether they hold the leader's parameters."""
        self.share()
        digests = self.group.digests(self.trained)
        agree = len(set(digests)) == 1
        if self.group.sharded:  # and the shards make up the leader's full copy
            agree = agree and digests[0] == params_digest(self.model)
        return len(digests), agree

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.group.share_optimizer(optimizer)

    def stop(self) -> None:
        self.group.stop()

    def close(self) -> None:
        self.group.close()


class NoSite:
    """A node without a site: it trains its model itself, and there is nothing to keep
    in step (the same interface as :class:`SiteLeader`)."""

    sharded = False

    def __init__(self) -> None:
        self.changed = False  # nothing to share, ever

    def model_changed(self) -> None:
        pass

    def step(self, trainer: Any) -> Any:
        return trainer.step()

    def share(self) -> None:
        pass

    def pull(self, stopping: bool) -> None:
        pass

    def agree(self) -> None:
        """No ranks to compare."""
        return None

    def share_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def assign(self, round_: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass
