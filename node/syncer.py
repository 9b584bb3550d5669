"""One fragment sync, split in two so the exchange overlaps with training.

:meth:`Syncer.launch` runs on the training thread: it takes the fragment's
pseudo-gradient (global - local), encodes it with error feedback and hands the
matchmaking and all-reduce to the transport's loop, returning at once.
:meth:`Syncer.apply` runs later on the training thread: it applies the outer step to
the fragment's global copy and merges the new global value into the local copy as in
Streaming DiLoCo (Douillard et al., 2025): ``local = alpha * local + (1 - alpha) *
global`` (``alpha = 0`` is plain DiLoCo: local := global).

A sync that fails (no group, deadline, transport error) applies nothing; the node's
global copy of that fragment then lags the swarm's, so the round is marked for a
re-sync from a peer, and the work already done stays in the local copy and is
contributed at the next sync (see :func:`staleness_weight`).

When a round's group does not span the whole swarm (more peers than
``network.group_size``, or ``sync.averaging = "gossip"``), nodes' global copies
differ, and averaging pseudo-gradients alone would let them drift apart for good. The
group then also averages its members' global copies (a second all-reduce of the same
fragment, through the same screening, signatures and codec code, under fragment id
``F + f`` and ``sync.mix_codec``):

* ``allreduce`` mode (butterfly mixing across groups, Moshpit SGD): the group adopts
  its mean global copy, then steps it with its mean pseudo-gradient; with the
  butterfly layout the swarm holds the exact global mean after ``rounds_to_mix``
  rounds (:mod:`protocol.grouping`).
* ``gossip`` mode (NoLoCo, Kolehmainen et al., 2025): pairs, and a modified Nesterov
  outer step whose gradient is the pair's mean pseudo-gradient plus
  ``gamma / lr * (own - mean)`` of the global copies, so the pull towards the partner
  runs through the outer momentum instead of replacing the weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol import codec as codecs
from protocol import grouping, matchmaking
from protocol.parts import AllReduceResult

if TYPE_CHECKING:
    from node.daemon import Node

__all__ = ["Pending", "Syncer", "staleness_weight"]

logger = logging.getLogger(__name__)


def staleness_weight(tokens: int, missed: int) -> int:
    """Token weight of work that spans ``missed`` skipped syncs: ``tokens / (1 + missed)``.

    Work folded in from earlier rounds was done against an older global value; it
    still counts, but less than fresh work, so one node that fell behind cannot
    dominate the round it catches up in.
    """
    return int(tokens / (1 + max(0, missed)))


@dataclass
class Pending:
    """A sync in flight."""

    round: int
    fragment: int
    tokens: int
    step: int
    started: float
    future: concurrent.futures.Future
    weights: torch.Tensor
    """The fragment's global copy as sent if the group mixes weights (mix codec applied)."""


class Syncer:
    """Launches and applies fragment syncs for one node."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.missed = [0] * len(node.plan)

    def launch(self, r: int, f: int, tokens: int) -> Pending:
        """Start syncing fragment ``f`` for round ``r`` in the background."""
        node, cfg = self.node, self.node.cfg
        assert node.transport is not None
        pg = node.outer.pseudo_gradient(node.model, f)
        if cfg.sync.error_feedback:
            enc = node.feedback[f].encode(pg)
        else:
            enc = codecs.encode(pg, cfg.sync.codec, block_size=cfg.sync.block_size)
        contribution = codecs.decode(enc, expected_numel=pg.numel())
        weight = staleness_weight(tokens, self.missed[f])
        node.allreduce.current_round = max(node.allreduce.current_round, r)
        node.verifier.round = max(node.verifier.round, r)
        # Wait for every live peer, suspects included: they count in everyone's view of
        # the round, and whether they are left out is decided by vote (voted_out).
        expected = node.live_peers()
        excludes = node.verifier.excluded(list(expected), r)
        # Whether the group mixes weights is decided from the announced peers; the copy
        # is taken now, on the training thread, in case it does.
        enc = codecs.encode(
            node.outer.global_vector(f), cfg.sync.mix_codec, block_size=cfg.sync.block_size
        )
        weights = codecs.decode(enc, expected_numel=pg.numel())
        future = node.transport.submit(
            self._exchange(r, f, weight, contribution, expected, excludes, weights)
        )
        return Pending(r, f, weight, node.trainer.steps, time.monotonic(), future, weights)

    def group_size(self) -> int:
        """Largest group of a round: pairs in gossip mode, else ``network.group_size``."""
        cfg = self.node.cfg
        return 2 if cfg.sync.averaging == "gossip" else cfg.network.group_size

    def mixes(self, swarm_size: int) -> bool:
        """Whether a swarm of ``swarm_size`` nodes averages weights as well (see above)."""
        return self.node.cfg.sync.averaging == "gossip" or swarm_size > self.group_size()

    async def _exchange(
        self,
        r: int,
        f: int,
        weight: int,
        contribution: torch.Tensor,
        expected: set[str],
        excludes: set[str],
        weights: torch.Tensor,
    ) -> tuple[list[str], AllReduceResult, AllReduceResult | None]:
        node, net = self.node, self.node.cfg.network
        assert node.transport is not None
        announced = await matchmaking.gather(
            node.transport,
            node.identity,
            node.cfg.run.run_id,
            r,
            f,
            weight,
            expected=expected,
            deadline=time.monotonic() + net.matchmaking_seconds,
            expiration=net.round_timeout * 4,
            timeout=net.request_timeout,
            excludes=excludes,
        )
        me = node.identity.peer_id
        peers = set(announced) - matchmaking.voted_out(announced)
        size, layout = self.group_size(), node.cfg.sync.layout
        group = grouping.group_of(me, peers, r, f, size, layout)
        if not self.mixes(len(peers | {me})):
            return group, await node.allreduce.run(r, f, group, contribution, weight), None
        # Every member's global copy counts the same, whatever its token count.
        result, mixed = await asyncio.gather(
            node.allreduce.run(r, f, group, contribution, weight),
            node.allreduce.run(r, len(node.plan) + f, group, weights, 1),
        )
        return group, result, mixed

    def apply(self, pending: Pending, timeout: float) -> dict[str, Any] | None:
        """Wait for ``pending`` (up to ``timeout``), apply it; None when the sync failed."""
        node, f = self.node, pending.fragment
        try:
            group, result, mixed = pending.future.result(timeout)
        except Exception as exc:  # any failure of the exchange: nothing to apply
            pending.future.cancel()
            self.missed[f] += 1
            logger.warning("round %d fragment %d: sync failed: %r", pending.round, f, exc)
            node.events.write("sync_failed", round=pending.round, fragment=f, error=repr(exc))
            return None
        averaged = result.vector.to(node.device)
        if mixed is None:
            node.outer.step(f, averaged)
        else:
            self._mix(f, averaged, pending.weights, mixed.vector.to(node.device))
        alpha = node.cfg.sync.alpha
        if alpha == 0.0:
            node.outer.sync_local(node.model, f)
        else:
            params = dict(node.model.named_parameters())
            local = node.plan.flatten(params, f)
            merged = alpha * local + (1.0 - alpha) * node.outer.global_vector(f)
            node.plan.write(params, f, merged)
        self.missed[f] = 0
        record = {
            "round": pending.round,
            "fragment": f,
            "group": group,
            "contributors": result.contributors,
            "fallback_parts": result.fallback_parts,
            "repaired_parts": result.repaired_parts,
            "complete": result.complete,
            "tokens": pending.tokens,
            "bytes_sent": result.bytes_sent + (mixed.bytes_sent if mixed else 0),
            "mixed": mixed is not None,
            "seconds": time.monotonic() - pending.started,
            "overlap_steps": node.trainer.steps - pending.step,
        }
        node.events.write("sync", **record)
        return record

    def _mix(self, f: int, averaged: torch.Tensor, own: torch.Tensor, mean: torch.Tensor) -> None:
        """Outer step of a group that does not span the swarm (see the module docstring)."""
        node, cfg = self.node, self.node.cfg
        own = own.to(mean.device)
        if cfg.sync.averaging == "gossip":
            pull = (cfg.sync.gossip_gamma / cfg.outer.lr) * (own - mean)
            node.outer.step(f, averaged + pull)
        else:
            node.outer.set_global(f, mean)
            node.outer.step(f, averaged)
