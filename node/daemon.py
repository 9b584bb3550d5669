"""One node's life: start, join, catch up, train with fragment syncs, checkpoint, leave.

:meth:`Node.run` reads top to bottom. The training loop is synchronous; every
network exchange is a coroutine handed to the transport's loop with a deadline, so
a slow or vanished peer costs at most that deadline.
"""

from __future__ import annotations

import importlib.metadata
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
from node.clock import SecondsClock
from node.config import AtollConfig
from node.controlplane import ControlPlane
from node.data import BatchStream, load_corpus
from node.metrics import EventLog, StatusWriter
from node.model import build_model
from node.outer import OuterOptimizer, sync_schedule
from node.simulate import resolve_device
from node.syncer import Pending, Syncer
from node.trainer import InnerTrainer, evaluate
from node.verifier import Verifier
from protocol import codec as codecs
from protocol import matchmaking
from protocol.allreduce import AllReduceService, AllReduceSettings
from protocol.errors import ProtocolError
from protocol.fragments import plan_fragments
from protocol.messages import Header, open_envelope, seal
from protocol.transport import Transport, TransportConfig
from verification.identity import Identity

__all__ = ["Node"]

logger = logging.getLogger(__name__)

try:
    __version__ = importlib.metadata.version("atoll")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

_LIVE_SECONDS = 10.0  # a registry record older than this is a peer presumed gone


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
        self.control: ControlPlane | None = None
        self.live: dict[str, matchmaking.PeerRecord] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.busy = 0.0
        self.join_round = 0
        self.train_started = time.monotonic()

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Run until ``run.max_rounds`` rounds are done or SIGINT/SIGTERM; return an exit code."""
        self._install_signals()
        try:
            self._setup()
            self._wait_for_peers()
            if self.cfg.sync.trigger == "seconds":
                self.clock = self._agree_clock()
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
        if cfg.control.enabled:
            self.control = ControlPlane(
                cfg.control,
                cfg.run.run_id,
                self.identity,
                self.data_dir / "identity.key",
                self.data_dir,
                self.verifier,
                self.events,
                self._vitals,
                __version__,
            )
            self.control.start()
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
                # fragment ids F..2F-1 carry global copies when groups mix weights
                fragments=2 * len(self.plan),
                fragment_codecs=(cfg.sync.codec,) * len(self.plan)
                + (cfg.sync.mix_codec,) * len(self.plan),
            ),
            reducer=self.verifier.reduce,
            judge=self.verifier,
            faults=make_behaviour(self.byzantine, seed=cfg.run.seed),
            commitments=self.control if cfg.control.commit else None,
        )
        self.allreduce.register()
        self.state_server = catchup.StateServer(self.transport, self.identity, cfg.run.run_id)
        self.state_server.register()
        self.status.update(
            force=True,
            maddrs=self.transport.maddrs,
            params=self.plan.numel,
            helper_pids=self._helper_pids(),
        )
        self._resume()
        self.state_server.publish(
            catchup.StateSnapshot.take(
                self.round, self.plan.digest(), self.outer, self.trainer.steps
            )
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

    def _resync(self, r: int) -> bool:
        """Take the swarm's state of round ``r`` (peers may be a moment behind: retry)."""
        deadline = time.monotonic() + max(5.0, self.cfg.network.round_timeout)
        while not self.stop_event.is_set():
            if self._catch_up(min_round=r, rebase=True):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return False

    def _catch_up(self, min_round: int, rebase: bool = False) -> bool:
        """Take the newest global state from a live peer at ``min_round`` or later.

        With ``rebase`` this node's unsynced local work is kept: each fragment's local
        copy moves by the same amount as its global copy, so the work is contributed at
        the next sync instead of being thrown away.
        """
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
        if not candidates:
            return False
        newest = candidates[0].round
        spread = [r.peer for r in candidates if r.round == newest][: len(sizes)]
        signers = max(1, min(self.cfg.trust.state_signers, len(registry) - 1))
        # First spread the download over every peer of the newest round; then one peer at
        # a time, in case one of them serves something else.
        attempts = [spread] + [[r.peer] for r in candidates[:3]]
        for peers in attempts:
            try:
                snap = self.transport.run(
                    catchup.fetch_state(
                        self.transport,
                        self.identity,
                        self.cfg.run.run_id,
                        peers,
                        plan_digest=self.plan.digest(),
                        sizes=sizes,
                        min_round=min_round,
                        signers=signers,
                        timeout=net.request_timeout,
                        max_bytes=int(net.max_message_mb * 2**20),
                    ),
                    net.request_timeout * (len(sizes) + 1) + 5,
                )
            except (ProtocolError, TimeoutError) as exc:
                logger.warning("catch-up from %s failed: %s", ", ".join(p[:12] for p in peers), exc)
                continue
            before = [self.outer.global_vector(f) for f in range(len(self.plan))]
            snap.apply(self.outer)
            params = dict(self.model.named_parameters())
            for f in range(len(self.plan)):
                if rebase:
                    local = self.plan.flatten(params, f)
                    self.plan.write(params, f, local + self.outer.global_vector(f) - before[f])
                else:
                    self.outer.sync_local(self.model, f)
                    self.feedback[f].reset()
            self.round = max(self.round, snap.round)
            # Follow the swarm's place in the inner learning-rate schedule: a newcomer
            # at its warmup peak would take steps far larger than everyone else's.
            self.trainer.steps = max(self.trainer.steps, snap.steps)
            self.events.write("catch_up", round=self.round, sources=peers)
            return True
        return False

    def _agree_clock(self) -> SecondsClock:
        """Read the run's round clock from the DHT, or start one if this node is first."""
        assert self.transport is not None
        cfg, net = self.cfg, self.cfg.network
        key = f"{cfg.run.run_id}:manifest"
        deadline = time.monotonic() + (10.0 if self.initial_peers else 0.0)
        while not self.stop_event.is_set():
            found = self.transport.run(
                self.transport.dht_get(key, timeout=net.request_timeout), net.request_timeout + 5
            )
            clocks = []
            for signer, value in (found or {}).items() if isinstance(found, dict) else []:
                try:
                    env = open_envelope(
                        value,
                        max_bytes=4096,
                        expected_sender=signer,
                        run_id=cfg.run.run_id,
                        kinds=("manifest",),
                    )
                    t0, length = env.body.get("t0"), env.body.get("round_seconds")
                    if isinstance(t0, float) and isinstance(length, float) and length > 0:
                        clocks.append((t0, length, signer))
                except ProtocolError as exc:
                    logger.info("manifest under %s refused: %s", signer[:16], exc)
            if clocks:
                t0, length, signer = min(clocks)  # the earliest clock of the run wins
                logger.info("round clock from %s: t0 %.1f, %.1fs rounds", signer[:16], t0, length)
                return SecondsClock(t0, length, len(self.plan))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        t0 = float(
            SecondsClock.start_time(cfg.sync.round_seconds, lead=2 * net.registry_seconds + 1)
        )
        body = {"t0": t0, "round_seconds": float(cfg.sync.round_seconds)}
        header = Header("manifest", cfg.run.run_id, 0, 0, 0, self.identity.peer_id)
        self.transport.run(
            self.transport.dht_store(
                key, self.identity.peer_id, seal(self.identity, header, body), 7 * 86400.0
            ),
            net.request_timeout + 5,
        )
        logger.info("started the round clock: t0 %.1f, %.1fs rounds", t0, cfg.sync.round_seconds)
        return SecondsClock(t0, cfg.sync.round_seconds, len(self.plan))

    def _wait_for_peers(self) -> None:
        net = self.cfg.network
        deadline = time.monotonic() + net.min_peers_timeout
        while len(self.live_peers()) + 1 < net.min_peers and not self.stop_event.is_set():
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
        if self.control is not None:
            self.control.close()
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
        self.status.update(force=True, state="training")
        self.train_started = time.monotonic()
        self.syncer = Syncer(self)
        if self.cfg.sync.trigger == "steps":
            self._train_steps()
        else:
            self._train_seconds()
        self._linger()

    def _linger(self) -> None:
        """After the last round, stay reachable while a live peer is still behind
        (bounded by how long its last sync may take): a peer whose last sync failed
        re-syncs from the swarm's state, and it can only take it from running nodes."""
        if self.stop_event.is_set() or not self.cfg.run.max_rounds:
            return
        net = self.cfg.network
        # as long as a lagging peer's last sync can take (see _apply), and no longer
        bound = net.matchmaking_seconds + 3 * net.round_timeout
        me, deadline = self.identity.peer_id, time.monotonic() + bound
        self.status.update(force=True, state="lingering", round=self.round)
        while time.monotonic() < deadline and not self.stop_event.is_set():
            now = time.time()
            behind = [
                p
                for p, rec in self.live.items()
                if p != me and now - rec.updated < _LIVE_SECONDS and rec.round < self.round
            ]
            if not behind:
                return
            time.sleep(0.5)

    def _step(self, tokens_since: list[int]) -> None:
        """One inner step, stretched by ``run.slowdown``; counts busy time."""
        started = time.monotonic()
        result = self.trainer.step()
        if self.cfg.run.slowdown > 1.0:
            # Stand in for slower hardware: the extra time is compute time, not idle.
            time.sleep((time.monotonic() - started) * (self.cfg.run.slowdown - 1.0))
        self.busy += time.monotonic() - started
        for f in range(len(tokens_since)):
            tokens_since[f] += result.tokens
        wall = time.monotonic() - self.train_started
        self.status.update(
            step=self.trainer.steps,
            loss=result.loss,
            round=self.round,
            tokens=self.trainer.tokens,
            busy_seconds=self.busy,
            idle_seconds=max(0.0, wall - self.busy),
        )

    def _train_steps(self) -> None:
        """``steps`` mode: H inner steps per round, every node the same count."""
        cfg = self.cfg
        schedule = sync_schedule(cfg.sync.inner_steps, len(self.plan))
        tau = cfg.sync.tau
        while not self.stop_event.is_set():
            if cfg.run.max_rounds and self.round >= cfg.run.max_rounds:
                break
            r = self.round + 1
            tokens_since = [0] * len(self.plan)
            pending: list[Pending] = []
            failed = False
            for step in range(1, cfg.sync.inner_steps + 1):
                if self.stop_event.is_set():
                    return  # the interrupted round is abandoned; the last checkpoint stands
                self._step(tokens_since)
                for f in schedule.get(step, []):
                    pending.append(self.syncer.launch(r, f, tokens_since[f]))
                    tokens_since[f] = 0
                for p in [p for p in pending if self.trainer.steps - p.step >= tau]:
                    pending.remove(p)
                    failed |= self._apply(p) is None
            for p in pending:  # the round ends with every sync applied
                failed |= self._apply(p) is None
            self._end_round(r, resync=failed)

    def _train_seconds(self) -> None:
        """``seconds`` mode: syncs on the swarm's wall clock; no node waits for another."""
        cfg, clock = self.cfg, self.clock
        fragments = len(self.plan)
        in_progress = clock.round_at(time.time())
        tokens_since = [0] * fragments
        pending: dict[int, Pending] = {}
        done: dict[int, set[int]] = {}
        failed: set[int] = set()
        on_time = (
            self.round == in_progress - 1
            and time.time() < clock.sync_time(in_progress, 0) - self.cfg.network.matchmaking_seconds
        )
        if self.round < in_progress and not on_time:
            # Behind the swarm (joining, or back from a restart): sit out the round in
            # progress, training all the same, and re-sync from a peer when it ends; the
            # work done meanwhile is rebased onto the swarm's state and contributed next.
            self.join_round = in_progress + 1
            self.events.write(
                "join", round=in_progress, state_round=self.round, contributes_from=self.join_round
            )
            self.round = in_progress - 1
        last = (self.round, fragments - 1)
        while not self.stop_event.is_set():
            if cfg.run.max_rounds and self.round >= cfg.run.max_rounds:
                break
            self._step(tokens_since)
            for r, f in clock.due(time.time(), last):
                last = (r, f)
                if r < self.join_round:
                    self.syncer.missed[f] += 1
                    done.setdefault(r, set()).add(f)
                    failed.add(r)
                    continue
                if f in pending:
                    # The previous sync of f is still in flight: skip this one; the work
                    # stays in the local copy and is folded into the next sync.
                    self.syncer.missed[f] += 1
                    done.setdefault(r, set()).add(f)
                    failed.add(r)
                    continue
                pending[f] = self.syncer.launch(r, f, tokens_since[f])
                tokens_since[f] = 0
            for f, p in list(pending.items()):
                if p.future.done() and self.trainer.steps - p.step >= cfg.sync.tau:
                    del pending[f]
                    if self._apply(p) is None:
                        failed.add(p.round)
                    done.setdefault(p.round, set()).add(f)
            while done.get(self.round + 1, set()) >= set(range(fragments)):
                r = self.round + 1
                done.pop(r)
                self._end_round(r, resync=r in failed or r < self.join_round)
        for p in pending.values():
            p.future.cancel()

    def _apply(self, pending: Pending) -> dict[str, Any] | None:
        """Apply a finished sync; None when it failed or averaged alone while peers live."""
        net = self.cfg.network
        record = self.syncer.apply(pending, net.matchmaking_seconds + net.round_timeout * 3 + 10)
        if record is None:
            return None
        self.bytes_sent += record["bytes_sent"]
        self.status.update(peers=len(record["group"]), bytes_sent=self.bytes_sent)
        if len(record["group"]) == 1 and self.live_peers():
            logger.warning("round %d fragment %d: averaged alone", pending.round, pending.fragment)
            return None
        if record["fallback_parts"] and self.live_peers():
            # Parts kept at local values drift from the swarm: take its state at round end.
            return None
        return record

    def _end_round(self, r: int, resync: bool) -> None:
        self.round = r
        if resync and self.syncer.mixes(len(self.live_peers()) + 1):
            # Global copies differ across the swarm by design: there is no one state to
            # take; the next rounds' mixing pulls this node's copy back in.
            logger.info("round %d: no re-sync while groups mix weights", r)
        elif resync and self.live_peers():
            if self._resync(r):
                logger.warning("round %d: this node's global copy lagged; re-synced from a peer", r)
            else:
                logger.warning("round %d: could not re-sync from any peer", r)
        snapshot = catchup.StateSnapshot.take(
            self.round, self.plan.digest(), self.outer, self.trainer.steps
        )
        digest = self.state_server.publish(snapshot)
        self.transport.submit(
            self.state_server.attest(self.round, digest, timeout=self.cfg.network.request_timeout)
        )
        fields: dict[str, Any] = {"round": self.round, "global_digest": digest}
        if self.round % self.cfg.run.eval_every == 0:
            fields["val_bpb"] = self._evaluate_global()
        fields.update(
            tokens=self.trainer.tokens, steps=self.trainer.steps, bytes_sent=self.bytes_sent
        )
        fields["flagged"] = self.verifier.flagged(self.round)
        if self.round % self.cfg.run.checkpoint_every == 0:
            self._checkpoint()  # before the status says the round is done
        self.events.write("round", **fields)
        self.status.update(force=True, **fields)
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

    def _helper_pids(self) -> list[int]:
        """Processes this node started besides itself (p2pd, DHT, control sidecar)."""
        pids = list(self.transport.helper_pids) if self.transport else []
        if self.control is not None and self.control.sidecar_pid:
            pids.append(self.control.sidecar_pid)
        return pids

    def _vitals(self) -> dict[str, Any]:
        """What this node's heartbeats say about it."""
        trainer = getattr(self, "trainer", None)
        tokens = trainer.tokens if trainer else 0
        return {
            "round": self.round,
            "step": trainer.steps if trainer else 0,
            "throughput": round(tokens / self.busy, 1) if self.busy > 0 else 0.0,
            "device": str(getattr(self, "device", "")),
        }

    def live_peers(self) -> set[str]:
        """Peers whose registry record is fresh (this node excluded)."""
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
                    control=self.control.addrs if self.control else (),
                )
                self.live = await matchmaking.read_registry(
                    self.transport, self.cfg.run.run_id, timeout=net.request_timeout
                )
            except ProtocolError as exc:
                logger.debug("registry refresh failed: %s", exc)
            if self.control is not None:
                for rec in self.live.values():
                    if rec.peer != self.identity.peer_id:
                        self.control.connect(rec.control)
                self.status.update(
                    control_addrs=self.control.addrs,
                    swarm=self.control.swarm(),
                    reputations=self.verifier.reputations(),
                    helper_pids=self._helper_pids(),
                )
            await asyncio.sleep(net.registry_seconds)
