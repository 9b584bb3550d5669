"""Single-process DiLoCo reference: K replicas, pseudo-gradients averaged in memory.

This is the algorithm the networked node must match: every replica trains its own
copy on its own shard, each fragment syncs at its staggered point of the round, its
pseudo-gradient goes through the configured codec (with error feedback), the decoded
pseudo-gradients are averaged weighted by tokens, and every replica applies the same
outer step: ``sync.tau`` inner steps after the sync started (or at the round's end,
whichever comes first), merging the steps taken meanwhile as the node does
(:meth:`~node.train.outer.OuterOptimizer.merge_local`, with ``sync.alpha``). Each round's
score is the global copy's validation bits per byte.

With more replicas than ``network.group_size``, each sync averages within the groups
the node forms (:func:`protocol.averaging.grouping.form_groups`, ``sync.layout``, the
replicas named ``replica-000``, ...), and the groups mix their global copies as a
node's do (:meth:`~node.train.outer.OuterOptimizer.step_mixed`: the group's mean copy in
``sync.mix_codec``, adopted in ``allreduce`` mode, a NoLoCo pull in ``gossip`` mode).
Copies then differ between groups; the score is replica 0's, as a node scores its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from node.config import AtollConfig
from node.data.corpus import BatchStream, load_data, site_slice, validation_batches
from node.settings import allreduce_settings
from node.train.bindings import bind
from node.train.model import build_model, vocab_of
from node.train.outer import OuterOptimizer, sync_schedule
from node.train.trainer import InnerTrainer, evaluate
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.grouping import form_groups
from protocol.wire import codec as codecs
from protocol.wire.feedback import ErrorFeedback, FeedbackSettings
from verification import means

__all__ = ["resolve_device", "simulate", "weighted_mean"]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cuda:N`` must name a device present.

    Raises:
        ValueError: CUDA asked for where there is none, or fewer devices than ``N + 1``.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"config error: run.device = {name!r} but no CUDA device is available")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"config error: run.device = {name!r} but this machine has {count} CUDA "
            f"device(s): cuda:0 to cuda:{count - 1}"
        )
    return device


def weighted_mean(vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Mean of ``vectors`` weighted by ``weights`` (need not sum to one): the all-reduce's
    own weighted mean (:func:`verification.means.weighted_mean`).

    Raises:
        ValueError: the weights do not have a positive sum (no replica trained).
    """
    if float(sum(weights)) <= 0:
        raise ValueError("weights must have a positive sum")
    return means.weighted_mean(vectors, weights)


@dataclass
class _Pending:
    """A fragment's averaged pseudo-gradients waiting to be applied."""

    step: int
    """The inner step its sync was launched at."""
    fragment: int
    averaged: list[torch.Tensor]
    """Each replica's group's mean pseudo-gradient (the same tensor across a group)."""
    sent_from: list[torch.Tensor]
    """Each replica's local copy of the fragment it came from (empty: applied as is)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Where groups mix: each replica's global copy as sent and its group's mean copy."""


class _Simulation:
    """``replicas`` DiLoCo replicas of one config, trained and synced in this process."""

    def __init__(self, cfg: AtollConfig, replicas: int, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
        train = site_slice(self.corpus.train, cfg.data.site, cfg.data.sites, cfg.model.context)
        base = build_model(cfg.model, seed=cfg.run.seed).to(device)
        self.models = [
            build_model(cfg.model, seed=cfg.run.seed).to(device) for _ in range(replicas)
        ]
        self.plan = plan_fragments(base, cfg.sync.fragments)
        # what an owner answers with, as a node's all-reduce encodes it (in a gather
        # every member reduces the parts itself: nothing is encoded again)
        settings = allreduce_settings(cfg, len(self.plan))
        self.result_codec = None if settings.gather else settings.wire_codec("update", True)
        self.outers = [OuterOptimizer(m, self.plan, cfg.outer) for m in self.models]
        self.trainers = [
            InnerTrainer(
                m,
                cfg.train,
                BatchStream(train, cfg.data.batch_size, cfg.model.context, (cfg.run.seed, i)),
                device,
            )
            for i, m in enumerate(self.models)
        ]
        self.feedback = [
            [_error_feedback(cfg, i, f) for f in range(len(self.plan))] for i in range(replicas)
        ]
        self.val_batches = validation_batches(
            self.corpus.val, cfg.data.batch_size, cfg.model.context, cfg.train.eval_batches
        )
        self.schedule = sync_schedule(cfg.sync.inner_steps, len(self.plan))
        self.names = [f"replica-{i:03d}" for i in range(replicas)]
        self.mixes = replicas > cfg.network.group_size
        # What is scored is the global copy (the averaged model every replica agrees on,
        # the one a node evaluates and a user keeps), loaded into a model of its own.
        self.scored = build_model(cfg.model, seed=cfg.run.seed).to(device)
        self.payload_bytes = 0
        """Bytes of one replica's encoded pseudo-gradients, over every sync so far."""
        self.result_bytes = 0
        """Bytes of the averaged pseudo-gradients as owners encode them (for ``topk``, the
        union of the kept values as ``sparse``; otherwise the same size as a replica's;
        none in a gather)."""

    def score(self) -> float:
        """The global copy's validation bits per byte."""
        self.outers[0].write_globals(self.scored)
        return evaluate(self.scored, self.val_batches, self.device, self.corpus.bytes_per_token)

    def round(self, r: int) -> list[float]:
        """Train and sync every replica through round ``r``; returns the inner losses."""
        sync = self.cfg.sync
        round_tokens = [0] * len(self.trainers)
        losses = []
        pending: list[_Pending] = []
        for step in range(1, sync.inner_steps + 1):
            for i, trainer in enumerate(self.trainers):
                result = trainer.step()
                round_tokens[i] += result.tokens
                losses.append(result.loss)
            for f in self.schedule.get(step, []):
                pending.append(self._sync(r, step, f, round_tokens))
            due = [p for p in pending if step - p.step >= sync.tau or step == sync.inner_steps]
            for p in due:  # a round ends with every sync applied, as on a node
                pending.remove(p)
                self._apply(p, r)
        return losses

    def _sync(self, r: int, step: int, f: int, round_tokens: list[int]) -> _Pending:
        """Every replica's pseudo-gradient of fragment ``f`` through the codec, averaged
        by the tokens each trained this round, over the swarm or within each group."""
        sync = self.cfg.sync
        decoded, sent_from = [], []
        for i, model in enumerate(self.models):
            pg = self.outers[i].pseudo_gradient(model, f)
            enc = (
                self.feedback[i][f].encode(pg)
                if sync.error_feedback
                else codecs.encode(pg, sync.codec, **sync.codec_args())
            )
            if i == 0:
                self.payload_bytes += len(enc.payload)
            decoded.append(codecs.decode(enc, expected_numel=pg.numel()))
            if sync.tau or sync.alpha:
                sent_from.append(self.outers[i].local_vector(model, f))
        everyone = list(range(len(self.models)))
        groups = [everyone]
        if self.mixes:
            formed = form_groups(self.names, r, f, self.cfg.network.group_size, sync.layout)
            groups = [[self.names.index(name) for name in g] for g in formed]
        averaged: list[torch.Tensor] = [torch.empty(0)] * len(self.models)
        for group in groups:
            mean = weighted_mean(
                [decoded[i] for i in group], [float(round_tokens[i]) for i in group]
            )
            mean = self._result(mean, len(enc.payload) if 0 in group else 0).to(self.device)
            for i in group:
                averaged[i] = mean
        copies = self._mix(f, groups, round_tokens) if self.mixes else None
        return _Pending(step, f, averaged, sent_from, copies)

    def _result(self, averaged: torch.Tensor, payload: int) -> torch.Tensor:
        """The mean as owners answer it (for ``topk`` parts the union of the kept values,
        as ``sparse``), its bytes counted for replica 0's group (``payload``: the size of
        a non-sparse answer, 0 for another group)."""
        if self.result_codec is None:  # a gather: the exact mean, and no result sent
            return averaged
        if self.result_codec["codec"] == "sparse":
            result = codecs.encode(averaged, **self.result_codec)
            if payload:
                self.result_bytes += len(result.payload)
            return codecs.decode(result)
        self.result_bytes += payload
        return averaged

    def _mix(
        self, f: int, groups: list[list[int]], round_tokens: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each replica's global copy of ``f`` as sent (``sync.mix_codec``) and its group's
        token-weighted mean of them."""
        sync = self.cfg.sync
        sent = []
        for i, outer in enumerate(self.outers):
            own = outer.global_vector(f)
            enc = codecs.encode(own, sync.mix_codec, block_size=sync.block_size)
            if i == 0:
                self.payload_bytes += len(enc.payload)
            sent.append(codecs.decode(enc, expected_numel=own.numel()))
        copies: list[tuple[torch.Tensor, torch.Tensor]] = [(sent[0], sent[0])] * len(sent)
        for group in groups:
            mean = weighted_mean([sent[i] for i in group], [float(round_tokens[i]) for i in group])
            for i in group:
                copies[i] = (sent[i], mean.to(self.device))
        return copies

    def _apply(self, p: _Pending, r: int) -> None:
        """Every replica's outer step with ``p``, merging the steps taken meanwhile."""
        sync = self.cfg.sync
        pull = sync.gossip_gamma / self.cfg.outer.lr if sync.averaging == "gossip" else None
        for i, model in enumerate(self.models):
            outer, averaged = self.outers[i], p.averaged[i]
            if p.copies is not None:
                own, mean = p.copies[i]
                outer.step_mixed(p.fragment, averaged, own, mean, pull, r)
                sent_from = p.sent_from[i] if p.sent_from else None
                outer.merge_local(model, p.fragment, sync.alpha, sent_from)
            elif p.sent_from:
                outer.step(p.fragment, averaged, r)
                outer.merge_local(model, p.fragment, sync.alpha, p.sent_from[i])
            else:
                outer.apply(model, p.fragment, averaged, r)


def _error_feedback(cfg: AtollConfig, replica: int, fragment: int) -> ErrorFeedback:
    return FeedbackSettings(
        cfg.sync.codec,
        **cfg.sync.codec_args(),
        decay=cfg.sync.feedback_decay,
        stochastic=cfg.sync.stochastic_rounding,
    ).build(torch.Generator().manual_seed(cfg.run.seed * 1000 + replica * 31 + fragment))


def simulate(
    cfg: AtollConfig,
    replicas: int,
    rounds: int,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``replicas`` DiLoCo replicas for ``rounds`` rounds of ``sync.inner_steps`` steps.

    Returns:
        A summary with ``replicas``, ``rounds``, ``val_bpb_start``, ``val_bpb_end``,
        the per-round ``history``, ``payload_bytes_per_replica`` (one replica's encoded
        pseudo-gradients over every sync), ``result_bytes`` (the averaged ones as owners
        encode them) and ``syncs``.
    """
    if replicas < 1 or rounds < 1:
        raise ValueError("replicas and rounds must be >= 1")
    cfg = bind(cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    device = resolve_device(cfg.run.device)
    sim = _Simulation(cfg, replicas, device)
    start = time.perf_counter()
    bpb_start = sim.score()
    history: list[dict[str, Any]] = [{"round": 0, "val_bpb": bpb_start, "tokens": 0}]
    if progress:
        progress(dict(history[0], seconds=0.0, loss=float("nan")))
    for r in range(1, rounds + 1):
        losses = sim.round(r)
        entry = {
            "round": r,
            "val_bpb": sim.score(),
            "tokens": sum(t.tokens for t in sim.trainers),
            "loss": sum(losses) / len(losses),
            "seconds": time.perf_counter() - start,
        }
        history.append(entry)
        if progress:
            progress(entry)
    return {
        "replicas": replicas,
        "rounds": rounds,
        "inner_steps": cfg.sync.inner_steps,
        "fragments": len(sim.plan),
        "codec": cfg.sync.codec,
        "params": sim.plan.numel,
        "val_bpb_start": bpb_start,
        "val_bpb_end": history[-1]["val_bpb"],
        "tokens": history[-1]["tokens"],
        "payload_bytes_per_replica": sim.payload_bytes,
        "result_bytes": sim.result_bytes,
        "syncs": rounds * len(sim.plan),
        "seconds": time.perf_counter() - start,
        "history": history,
        "device": str(device),
    }
