"""One node's life: start, join, catch up, train with fragment syncs, checkpoint, leave.

:meth:`Node.run` reads top to bottom. The training loop is synchronous; every
network exchange is a coroutine handed to the transport's loop with a deadline, so
a slow or vanished peer costs at most that deadline.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from node import catchup
from node.byzantine import make_behaviour
from node.checkpoint import load_latest, save_checkpoint
from node.config import AtollConfig
from node.data import BatchStream, load_corpus
from node.metrics import EventLog, StatusWriter
from node.model import build_model
from node.outer import OuterOptimizer, sync_schedule
from node.simulate import resolve_device
from node.trainer import InnerTrainer, evaluate
from node.verifier import Verifier
from protocol import codec as codecs
from protocol import matchmaking
from protocol.allreduce import AllReduceService, AllReduceSettings
from protocol.errors import ProtocolError
from protocol.fragments import plan_fragments
from protocol.transport import Transport, TransportConfig
from verification.identity import Identity

__all__ = ["Node", "global_digest"]

logger = logging.getLogger(__name__)

_LIVE_SECONDS = 10.0  # a registry record older than this is a peer presumed gone


def global_digest(outer: OuterOptimizer) -> str:
    """Hex sha256 over every fragment's global values (bitwise agreement check)."""
    h = hashlib.sha256()
    for f in range(len(outer.globals)):
        h.update(outer.global_vector(f).numpy().tobytes())
    return h.hexdigest()


class Node:
    """A training node. Construct with a validated config, then call :meth:`run`.

    Args:
        cfg: the node's configuration.
        initial_peers: multiaddrs to join through (overrides ``network.initial_peers``).
        byzantine: a fault-injection mode (tests and benchmarks only); None is honest.
    """

    def __init__(
        self, cfg: AtollConfig, initial_peers: tuple[str, ...] = (), byzantine: str | None = None
    ) -> None:
        self.cfg = cfg
        self.byzantine = byzantine
        make_behaviour(byzantine)  # an unknown mode fails before anything starts
        self.initial_peers = initial_peers or cfg.network.initial_peers
        self.data_dir = Path(cfg.run.data_dir).expanduser()
        self.stop_event = threading.Event()
        self.round = 0
        self.transport: Transport | None = None
        self.live: dict[str, matchmaking.PeerRecord] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Run until ``run.max_rounds`` rounds are done or SIGINT/SIGTERM; return an exit code."""
        self._install_signals()
        try:
            self._setup()
            self._wait_for_peers()
            self._train()
            return 0
        finally:
            self._teardown()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: Any) -> None:
            logger.info("received %s: finishing", signal.Signals(signum).name)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _setup(self) -> None:
        cfg = self.cfg
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.status = StatusWriter(self.data_dir / "status.json")
        self.events = EventLog(self.data_dir / "events.jsonl")
        self.identity = Identity.load_or_create(self.data_dir / "identity.key")
        self.status.update(
            force=True, state="starting", pid=os.getpid(), peer_id=self.identity.peer_id
        )
        self.device = resolve_device(cfg.run.device)
        corpus = load_corpus(cfg.data, cfg.model.context)
        self.model = build_model(cfg.model, seed=cfg.run.seed).to(self.device)
        self.plan = plan_fragments(self.model, cfg.sync.fragments)
        self.outer = OuterOptimizer(self.model, self.plan, cfg.outer)
        stream = BatchStream(
            corpus.train, cfg.data.batch_size, cfg.model.context, self.identity.peer_id
        )
        self.trainer = InnerTrainer(self.model, cfg.train, stream, self.device)
        self.val_batches = BatchStream(
            corpus.val, cfg.data.batch_size, cfg.model.context, "validation"
        ).fixed_batches(cfg.train.eval_batches)
        self.feedback = [
            codecs.ErrorFeedback(
                cfg.sync.codec,
                block_size=cfg.sync.block_size,
                stochastic=cfg.sync.stochastic_rounding,
                generator=torch.Generator().manual_seed(f + 1),
            )
            for f in range(len(self.plan))
        ]
        net = cfg.network
        self.transport = Transport.start(
            TransportConfig(
                host=net.host,
                port=net.port,
                initial_peers=self.initial_peers,
                identity_path=self.data_dir / "identity.key",
                announce_maddrs=net.announce_maddrs,
                dht_client_mode=net.client_mode,
                request_timeout=net.request_timeout,
                max_message_bytes=int(net.max_message_mb * 2**20),
            )
        )
        self.verifier = Verifier(
            cfg.trust, self.data_dir / "atoll.db", self.identity.peer_id, self.events
        )
        self.allreduce = AllReduceService(
            self.transport,
            self.identity,
            AllReduceSettings(
                run_id=cfg.run.run_id,
                codec=cfg.sync.codec,
                block_size=cfg.sync.block_size,
                timeout=net.round_timeout,
                max_tokens=net.max_tokens_per_round,
                max_message_bytes=int(net.max_message_mb * 2**20),
                fragments=len(self.plan),
            ),
            reducer=self.verifier.reduce,
            observer=self.verifier,
            behaviour=make_behaviour(self.byzantine, seed=cfg.run.seed),
        )
        self.allreduce.register()
        self.state_server = catchup.StateServer(self.transport, self.identity, cfg.run.run_id)
        self.state_server.register()
        self.status.update(
            force=True,
            maddrs=self.transport.maddrs,
            params=self.plan.numel,
            helper_pids=self.transport.helper_pids,
        )
        self._resume()
        self.state_server.publish(
            catchup.StateSnapshot.take(self.round, self.plan.digest(), self.outer)
        )
        self._registry_task = self.transport.submit(self._registry_loop())
        self.eval_model = build_model(cfg.model, seed=cfg.run.seed).to(self.device)
        self.val_bpb_start = self._evaluate_global()
        self.status.update(
            force=True, state="ready", round=self.round, val_bpb_start=self.val_bpb_start
        )

    def _resume(self) -> None:
        """Resume from the newest valid checkpoint, else take the swarm's state if it has one."""
        found = load_latest(self.data_dir / "checkpoints")
        if found is not None:
            info, state = found
            if state.get("plan") != self.plan.digest():
                raise ValueError(f"checkpoint {info.path} is for another model or fragment plan")
            self.model.load_state_dict(state["model"])
            self.outer.load_state_dict(state["outer"])
            self.trainer.optimizer.load_state_dict(state["inner"])
            self.trainer.steps, self.trainer.tokens = state["steps"], state["tokens"]
            self.round = state["round"]
            logger.info("resumed from %s (round %d)", info.path.name, self.round)
            self.events.write("resume", round=self.round, checkpoint=info.path.name)
        if self.initial_peers:
            self._catch_up(min_round=self.round + 1)

    def _catch_up(self, min_round: int) -> bool:
        """Take the newest global state from a live peer at ``min_round`` or later."""
        assert self.transport is not None
        net = self.cfg.network
        registry = self.transport.run(
            matchmaking.read_registry(
                self.transport, self.cfg.run.run_id, timeout=net.request_timeout
            ),
            net.request_timeout + 5,
        )
        candidates = sorted(
            (
                r
                for r in registry.values()
                if r.peer != self.identity.peer_id and r.round >= min_round
            ),
            key=lambda r: (-r.round, r.peer),
        )
        sizes = [f.numel for f in self.plan.fragments]
        for record in candidates[:3]:
            try:
                snap = self.transport.run(
                    catchup.fetch_state(
                        self.transport,
                        self.identity,
                        self.cfg.run.run_id,
                        record.peer,
                        plan_digest=self.plan.digest(),
                        sizes=sizes,
                        min_round=min_round,
                        timeout=net.request_timeout,
                        max_bytes=int(net.max_message_mb * 2**20),
                    ),
                    net.request_timeout + 5,
                )
            except (ProtocolError, TimeoutError) as exc:
                logger.warning("catch-up from %s failed: %s", record.peer[:16], exc)
                continue
            snap.apply(self.outer)
            for f in range(len(self.plan)):
                self.outer.sync_local(self.model, f)
                self.feedback[f].reset()
            self.round = snap.round
            self.events.write("catch_up", round=self.round, source=record.peer)
            return True
        return False

    def _wait_for_peers(self) -> None:
        net = self.cfg.network
        deadline = time.monotonic() + net.min_peers_timeout
        while len(self._live_peers()) + 1 < net.min_peers and not self.stop_event.is_set():
            if time.monotonic() > deadline:
                logger.warning(
                    "only %d of %d peers after %.0fs; training anyway",
                    len(self.live) + 1,
                    net.min_peers,
                    net.min_peers_timeout,
                )
                break
            time.sleep(0.2)

    def _teardown(self) -> None:
        try:
            if hasattr(self, "outer") and self.round > 0:
                self._checkpoint()
        except Exception:
            logger.exception("final checkpoint failed")
        if self.transport is not None:
            self.transport.shutdown()
        if hasattr(self, "verifier"):
            self.verifier.close()
        if hasattr(self, "status"):
            self.status.update(force=True, state="stopped", round=self.round)
            self.events.write("stop", round=self.round)
            self.events.close()

    # ---- training -------------------------------------------------------------------------

    def _train(self) -> None:
        cfg = self.cfg
        schedule = sync_schedule(cfg.sync.inner_steps, len(self.plan))
        self.status.update(force=True, state="training")
        while not self.stop_event.is_set():
            if cfg.run.max_rounds and self.round >= cfg.run.max_rounds:
                break
            r = self.round + 1
            tokens_since = [0] * len(self.plan)
            alone = False
            for step in range(1, cfg.sync.inner_steps + 1):
                if self.stop_event.is_set():
                    return  # the interrupted round is abandoned; the last checkpoint stands
                result = self.trainer.step()
                tokens_since = [t + result.tokens for t in tokens_since]
                self.status.update(
                    step=self.trainer.steps,
                    loss=result.loss,
                    round=self.round,
                    tokens=self.trainer.tokens,
                )
                for f in schedule.get(step, []):
                    group_size = self._sync(r, f, tokens_since[f])
                    tokens_since[f] = 0
                    alone = alone or (group_size == 1 and bool(self._live_peers()))
            self._end_round(r, alone)

    def _sync(self, r: int, f: int, tokens: int) -> int:
        """Average fragment ``f`` for round ``r`` and apply the outer step; return the group size."""
        assert self.transport is not None
        cfg, net = self.cfg, self.cfg.network
        started = time.monotonic()
        pg = self.outer.pseudo_gradient(self.model, f)
        if cfg.sync.error_feedback:
            enc = self.feedback[f].encode(pg)
        else:
            enc = codecs.encode(pg, cfg.sync.codec, block_size=cfg.sync.block_size)
        contribution = codecs.decode(enc, expected_numel=pg.numel())
        self.allreduce.current_round = r
        self.verifier.round = r
        expected = self._live_peers() - self.verifier.excluded(list(self._live_peers()), r)
        announced = self.transport.run(
            matchmaking.gather(
                self.transport,
                self.identity,
                cfg.run.run_id,
                r,
                f,
                tokens,
                expected=expected,
                deadline=time.monotonic() + net.matchmaking_seconds,
                expiration=net.round_timeout * 4,
                timeout=net.request_timeout,
            ),
            net.matchmaking_seconds + net.request_timeout + 5,
        )
        peers = set(announced) - self.verifier.excluded(list(announced), r)
        group = matchmaking.group_of(self.identity.peer_id, peers, r, f, net.group_size)
        result = self.transport.run(
            self.allreduce.run(r, f, group, contribution, tokens), net.round_timeout * 3 + 10
        )
        self.outer.apply(self.model, f, result.vector.to(self.device))
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        self.events.write(
            "sync",
            round=r,
            fragment=f,
            group=group,
            contributors=result.contributors,
            fallback_parts=result.fallback_parts,
            repaired_parts=result.repaired_parts,
            complete=result.complete,
            tokens=tokens,
            bytes_sent=result.bytes_sent,
            seconds=time.monotonic() - started,
        )
        self.status.update(
            peers=len(group), bytes_sent=self.bytes_sent, bytes_received=self.bytes_received
        )
        return len(group)

    def _end_round(self, r: int, alone: bool) -> None:
        self.round = r
        if alone and self._catch_up(min_round=r):
            logger.warning("round %d: averaged alone while peers were live; re-synced", r)
        snapshot = catchup.StateSnapshot.take(self.round, self.plan.digest(), self.outer)
        self.state_server.publish(snapshot)
        fields: dict[str, Any] = {"round": self.round, "global_digest": global_digest(self.outer)}
        if self.round % self.cfg.run.eval_every == 0:
            fields["val_bpb"] = self._evaluate_global()
        fields.update(
            tokens=self.trainer.tokens, steps=self.trainer.steps, bytes_sent=self.bytes_sent
        )
        fields["flagged"] = self.verifier.flagged(self.round)
        self.events.write("round", **fields)
        self.status.update(force=True, **fields)
        if self.round % self.cfg.run.checkpoint_every == 0:
            self._checkpoint()
        logger.info(
            "round %d done: val_bpb %s, %d bytes sent",
            self.round,
            f"{fields['val_bpb']:.3f}" if "val_bpb" in fields else "-",
            self.bytes_sent,
        )

    def _evaluate_global(self) -> float:
        """Validation bits per byte of the global parameters (what the swarm agreed on)."""
        params = dict(self.eval_model.named_parameters())
        for f in range(len(self.plan)):
            self.plan.write(params, f, self.outer.global_vector(f))
        return evaluate(self.eval_model, self.val_batches, self.device)

    def _checkpoint(self) -> None:
        if getattr(self, "_checkpointed_round", None) == self.round:
            return
        self._checkpointed_round = self.round
        state = {
            "round": self.round,
            "plan": self.plan.digest(),
            "model": self.model.state_dict(),
            "outer": self.outer.state_dict(),
            "inner": self.trainer.optimizer.state_dict(),
            "steps": self.trainer.steps,
            "tokens": self.trainer.tokens,
        }
        info = save_checkpoint(self.data_dir / "checkpoints", self.round, state)
        self.events.write("checkpoint", round=self.round, file=info.path.name, digest=info.digest)

    # ---- peers ----------------------------------------------------------------------------

    def _live_peers(self) -> set[str]:
        now = time.time()
        return {
            p
            for p, rec in self.live.items()
            if p != self.identity.peer_id and now - rec.updated < _LIVE_SECONDS
        }

    async def _registry_loop(self) -> None:
        """Refresh this node's registry record and the view of live peers, forever."""
        import asyncio

        assert self.transport is not None
        net = self.cfg.network
        while not self.stop_event.is_set():
            try:
                await matchmaking.publish_record(
                    self.transport,
                    self.identity,
                    self.cfg.run.run_id,
                    self.round,
                    self.trainer.steps,
                    expiration=_LIVE_SECONDS,
                    timeout=net.request_timeout,
                )
                self.live = await matchmaking.read_registry(
                    self.transport, self.cfg.run.run_id, timeout=net.request_timeout
                )
            except ProtocolError as exc:
                logger.debug("registry refresh failed: %s", exc)
            await asyncio.sleep(net.registry_seconds)
