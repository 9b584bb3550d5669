"""One node's life: start, join, catch up, train with fragment syncs, checkpoint, leave.

:meth:`Node.run` reads top to bottom. The daemon wires the parts together and runs
the lifecycle; the parts do the work: :class:`~node.trainer.InnerTrainer` (inner
steps), :class:`~node.syncer.Syncer` (a fragment's sync),
:class:`~protocol.averaging.exchange.FragmentExchange` (matchmaking, groups, all-reduce),
:class:`~node.peers.PeerView` (who else is in the run), :class:`~verification.verifier.Verifier`
(trust) and :class:`~protocol.control.plane.ControlPlane` (heartbeats, commitments,
verdicts). The training loop is synchronous; every network exchange is a coroutine
handed to the transport's loop with a deadline, so a slow or vanished peer costs at
most that deadline.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node import catchup
from node.admin import AdminInbox, Command
from node.agreement import AgreementWatch, swarm_state
from node.bindings import bind
from node.byzantine import make_behaviour, training_data
from node.checkpoint import load_latest, save_checkpoint
from node.clock import SecondsClock
from node.clock import agree as agree_clock
from node.config import (
    AtollConfig,
    allreduce_settings,
    catchup_settings,
    clock_settings,
    control_settings,
    exchange_settings,
    peer_view_settings,
    transport_config,
)
from node.data import BatchStream, load_data, validation_batches
from node.handoff import workload_record
from node.load import LoadMeter, memory_per_param
from node.metrics import EventLog, StatusWriter, recent_events
from node.model import build_model, vocab_of
from node.monitor import Monitor
from node.outer import OuterOptimizer, sync_schedule
from node.peers import DuplicateIdentityError, PeerView
from node.simulate import resolve_device
from node.site import SiteGroup, SiteRank, params_digest, rank_data, stream_key
from node.spec import RunSpec, settings_digest
from node.syncer import Pending, Syncer
from node.trainer import InnerTrainer, evaluate, make_inner_optimizer
from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.exchange import FragmentExchange
from protocol.averaging.fragments import plan_fragments
from protocol.control.plane import ControlPlane
from protocol.errors import ProtocolError
from protocol.p2p.transport import BootstrapUnreachable, NotDialable, Transport
from protocol.wire import codec as codecs
from verification.identity import Identity
from verification.reputation import INITIAL_SCORE
from verification.verifier import Verifier

__all__ = ["Node"]

logger = logging.getLogger(__name__)

try:
    __version__ = importlib.metadata.version("atoll")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"


_BEHIND_ROUNDS = 2
"""More rounds than this between the clock and this node's last round: it fell behind
(normally the gap is one round, two while the last fragment's exchange finishes)."""


@dataclass
class _WallRun:
    """The bookkeeping of the ``seconds`` training loop."""

    tokens_since: list[int]
    pending: dict[int, Pending] = field(default_factory=dict)
    done: dict[int, set[int]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    last: tuple[int, int] = (0, 0)

    def skip(self, r: int, f: int, syncer: Syncer) -> None:
        """Fragment ``f`` of round ``r`` is not exchanged: its work goes into the next
        sync, and the round is re-synced from the swarm when it ends."""
        syncer.missed[f] += 1
        self.done.setdefault(r, set()).add(f)
        self.failed.add(r)


class Node:
    """A training node. Construct with a validated config, then call :meth:`run`.

    Args:
        cfg: the node's configuration (with a run spec's shared settings applied).
        initial_peers: multiaddrs to join through (overrides ``network.initial_peers``).
        byzantine: a fault-injection mode (tests and benchmarks only); None is honest.
        spec: the signed run spec this node joins (:mod:`node.spec`), if any: its
            digest is announced, and its clock is the run's clock.
    """

    def __init__(
        self,
        cfg: AtollConfig,
        initial_peers: tuple[str, ...] = (),
        byzantine: str | None = None,
        spec: RunSpec | None = None,
        site: SiteRank | None = None,
    ) -> None:
        cfg = bind(cfg)  # digests of the model config, first weights and tokenizer
        self.cfg = cfg
        self.site = site
        self.site_group: SiteGroup | None = None
        self._site_changed = True  # the model changed outside an inner step
        self.byzantine = byzantine
        make_behaviour(byzantine)  # an unknown mode fails before anything starts
        self.spec = spec
        self.spec_digest = spec.digest if spec is not None else settings_digest(cfg)
        self.initial_peers = initial_peers or cfg.network.initial_peers
        self.data_dir = Path(cfg.run.data_dir).expanduser()
        self.stop_event = threading.Event()
        self.round = 0
        self.transport: Transport | None = None
        self.control: ControlPlane | None = None
        self.peers: PeerView | None = None
        self.bytes_sent = 0
        self.busy = 0.0
        self.join_round = 0
        self.train_started = time.monotonic()
        self._warned_at = -1e9
        self._refused: dict[str, str] = {}  # peers refused during this run, and why
        self.agreement = AgreementWatch()  # this node's global digest against its peers'
        self._global_digest: tuple[int, str] | None = None  # (round, digest) last published
        self.alone_syncs = 0  # syncs averaged alone while peers were live

    # ---- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Run until ``run.max_rounds`` rounds are done or SIGINT/SIGTERM; return an exit code.

        Raises:
            DuplicateIdentityError: another running node uses this node's key.
            ValueError: a start-up problem the operator can fix (data directory,
                identity key, corpus, listen port), told in one line with the fix.
            OSError: a file in the data directory could not be written (a full disk).
        """
        self._install_signals()
        failed = True
        try:
            self._setup()
            self._wait_for_peers()
            if self.cfg.sync.trigger == "seconds":
                self.clock = self._agree_clock()
            self._train()
            if self.peers is not None and self.peers.conflict:
                raise DuplicateIdentityError(self.peers.conflict)
            failed = False
            return 0
        finally:
            self._teardown(quiet=failed)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: Any) -> None:
            logger.info("received %s: finishing", signal.Signals(signum).name)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _setup(self) -> None:
        self._open_data_dir()
        self._start_monitor()
        self._build_training()
        self._start_network()
        self._resume()
        self.state_server.publish(self._snapshot())
        self._registry_task = self.transport.submit(self._registry_loop())
        self.val_bpb_start = self._evaluate_global()
        self.status.update(
            force=True, state="ready", round=self.round, val_bpb_start=self.val_bpb_start
        )

    def _open_data_dir(self) -> None:
        from verification.errors import VerificationError

        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.run.threads:
            torch.set_num_threads(self.cfg.run.threads)
        self.status = StatusWriter(self.data_dir / "status.json")
        self.events = EventLog(self.data_dir / "events.jsonl")
        key_file = self.data_dir / "identity.key"
        new = "to make a new identity (the node gets a new PeerID)"
        try:
            self.identity = Identity.load_or_create(key_file)
        except VerificationError as exc:
            detail = exc.detail.removeprefix(f"{key_file}: ")
            raise ValueError(
                f"{key_file} is not a valid identity key ({detail}); "
                f"restore it from a backup or delete it {new}"
            ) from exc
        except IsADirectoryError as exc:
            raise ValueError(
                f"{key_file} is a directory, not an identity key file; put the key file "
                f"back from a backup, or remove the directory {new}"
            ) from exc
        self.status.update(
            force=True,
            state="starting",
            pid=os.getpid(),
            peer_id=self.identity.peer_id,
            run_id=self.cfg.run.run_id,
            spec=self.spec_digest,
            spec_file=self.spec is not None,
        )

    def _build_training(self) -> None:
        cfg = self.cfg
        key = self.identity.peer_id
        if self.site is None:
            self.device = resolve_device(cfg.run.device)
        else:
            # the site's leader: its ranks train in step with it (node.site)
            self.device = self.site.device(cfg.run.device)
            self.site_group = SiteGroup(self.site, self.device, cfg.train.sharding)
            key = self.site_group.agree_key(key)
        corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
        self.bytes_per_token = corpus.bytes_per_token
        # what a checkpoint needs to be exported and sampled elsewhere (node.handoff)
        self.workload = workload_record(cfg, corpus.tokenizer)
        # under FSDP the node's full copies (local, global, eval) live in CPU memory
        home = torch.device("cpu") if self._sharded() else self.device
        self.model = build_model(cfg.model, seed=cfg.run.seed).to(home)
        self.plan = plan_fragments(self.model, cfg.sync.fragments)
        # beside a GPU the outer state stays float32 in pinned host memory
        pin = self.device.type == "cuda"
        self.outer = OuterOptimizer(self.model, self.plan, cfg.outer, pin=pin)
        train = training_data(self.byzantine, rank_data(cfg, corpus.train, self.site), cfg.run.seed)
        stream = BatchStream(
            train, cfg.data.batch_size, cfg.model.context, stream_key(key, self.site)
        )
        trained, ranks = self.model, 1
        self.site_module = self.model  # what the site's ranks train: the model, or its shards
        if self.site_group is not None:
            if self._sharded():
                self.site_module = build_model(cfg.model, seed=cfg.run.seed).to(self.device)
            trained, ranks = self.site_group.wrap(self.site_module), self.site_group.site.world
        self.trainer = InnerTrainer(trained, cfg.train, stream, self.device, ranks=ranks)
        self._shards_ahead = False  # under FSDP: the shards trained past self.model
        self.val_batches = validation_batches(
            corpus.val, cfg.data.batch_size, cfg.model.context, cfg.train.eval_batches
        )
        self.feedback = [
            codecs.ErrorFeedback(
                cfg.sync.codec,
                block_size=cfg.sync.block_size,
                stochastic=cfg.sync.stochastic_rounding,
                generator=torch.Generator().manual_seed(f + 1),
                pin_memory=pin,
            )
            for f in range(len(self.plan))
        ]

    def _start_transport(self, key_file: Path) -> Transport:
        """Start the transport; keep trying initial peers that do not answer yet (the
        bootstrap node may come up after this one) for ``network.join_timeout``."""
        net = self.cfg.network
        # A bootstrap node joining its own run spec finds itself among the initial peers.
        self.initial_peers = tuple(
            m for m in self.initial_peers if not m.endswith(f"/p2p/{self.identity.peer_id}")
        )
        deadline = time.monotonic() + net.join_timeout
        while True:
            try:
                return Transport.start(transport_config(self.cfg, key_file, self.initial_peers))
            except BootstrapUnreachable as exc:
                left = deadline - time.monotonic()
                if left <= 0 or self.stop_event.is_set():
                    raise BootstrapUnreachable(
                        f"{exc} (tried for {net.join_timeout:.0f} s); check the addresses and "
                        "that those nodes run, with the port they listen on open to this host"
                    ) from exc
                logger.warning("%s; trying again in %.0f s", exc, min(5.0, left))
                self.status.update(force=True, state="joining", join_error=str(exc))
                self.stop_event.wait(min(5.0, left))
            except NotDialable as exc:
                raise NotDialable(
                    f"a peer could not dial this node back at its PeerID "
                    f"{self.identity.peer_id}: either another node is running with the identity "
                    f"key {key_file} (a copied data directory; give this one its own, or run "
                    "`atoll keygen --force` in it), or inbound connections to tcp port "
                    f"{net.port} are blocked (then set network.reachability = 'private')"
                ) from exc
            except RuntimeError as exc:
                # p2pd's own words (Go's strerror) for the two listen mistakes operators make
                if "address already in use" in str(exc):
                    raise ValueError(
                        f"tcp port {net.port} on {net.host} is in use; stop the other program "
                        "or choose another network.port"
                    ) from exc
                if "cannot assign requested address" in str(exc):
                    raise ValueError(
                        f"network.host {net.host} is not an address of this machine; set it to "
                        "one of its addresses, or 0.0.0.0 to listen on all of them"
                    ) from exc
                raise

    def _start_network(self) -> None:
        cfg, net = self.cfg, self.cfg.network
        key_file = self.data_dir / "identity.key"
        self.transport = self._start_transport(key_file)
        self.peers = PeerView(
            self.transport,
            self.identity,
            peer_view_settings(cfg, key_file, self.spec_digest, self.initial_peers),
            heard=self._heard,
        )
        self.transport.run(self.peers.ensure_identity_free(), 4 * net.request_timeout + 10)
        self.status.update(force=True, reachability=self.transport.reachability.to_dict())
        self.verifier = Verifier(
            cfg.trust, self.data_dir / "atoll.db", self.identity.peer_id, self.events
        )
        self.admin = AdminInbox(self.data_dir, self._operator)
        if cfg.control.enabled:
            self.control = ControlPlane(
                control_settings(cfg, key_file, self.data_dir),
                self.identity,
                self.transport,
                self.verifier,
                self.events,
                self._vitals,
                __version__,
            )
            self.control.start()
        self.allreduce = AllReduceService(
            self.transport,
            self.identity,
            allreduce_settings(cfg, len(self.plan)),
            reducer=self.verifier.reduce,
            planner=self.verifier.stream_plan,
            judge=self.verifier,
            faults=make_behaviour(self.byzantine, seed=cfg.run.seed),
            commitments=self.control.commitments if self.control and cfg.control.commit else None,
        )
        self.allreduce.register()
        self.exchange = FragmentExchange(
            self.transport,
            self.identity,
            self.allreduce,
            exchange_settings(cfg, self.spec_digest, len(self.plan)),
        )
        self.syncer = Syncer(
            cfg,
            self.model,
            self.outer,
            self.feedback,
            self.exchange,
            self.transport.submit,
            self.events,
            self.device,
        )
        self.state_server = catchup.StateServer(
            self.transport, self.identity, cfg.run.run_id, self.data_dir / "state"
        )
        self.state_server.register()
        self.load = LoadMeter(
            lambda: dict(self.transport.dht_usage) if self.transport else {},
            self._control_traffic,
            lambda: {
                "p2pd": self.transport.p2pd_pid if self.transport else None,
                "dht": self.transport.dht_pid if self.transport else None,
                "sidecar": self.control.sidecar_pid if self.control else None,
            },
        )
        self.status.update(
            force=True,
            maddrs=self.transport.maddrs,
            params=self.plan.numel,
            ranks=self.site.world if self.site is not None else 1,
            helper_pids=self._helper_pids(),
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
            if state.get("inner") is not None and not self._sharded():
                try:
                    self.trainer.optimizer.load_state_dict(state["inner"])
                except (ValueError, KeyError) as exc:
                    # the inner optimizer is this node's own: a fresh one only costs warmup
                    logger.warning(
                        "%s holds the state of another inner optimizer (train.optimizer "
                        "changed?): starting a fresh one (%s)",
                        info.path.name,
                        exc,
                    )
                    self.trainer.optimizer = make_inner_optimizer(
                        self.trainer.model, self.cfg.train
                    )
            self.trainer.steps, self.trainer.tokens = state["steps"], state["tokens"]
            self.round = state["round"]
            logger.info("resumed from %s (round %d)", info.path.name, self.round)
            self.events.write("resume", round=self.round, checkpoint=info.path.name)
        if self.initial_peers:
            self._catch_up(min_round=self.round + 1)

    def _take_swarm_state(self, r: int, digest: str, joining: bool) -> str:
        """After a round that went wrong, take the swarm's state of round ``r`` if it is
        not this node's own (``digest``); return the digest this node holds now.

        The node signs its digest as unsettled (or joining), waits until every live peer
        has signed one for the round (at most ``max(5, network.round_timeout)`` s), and
        takes :func:`node.agreement.swarm_state` of the signatures: every node that lost
        a sync picks the same state, so none waits on another that is re-syncing too.
        """
        assert self.transport is not None
        net = self.cfg.network
        standing = "joining" if joining else "unsettled"
        self.transport.run(
            self.state_server.attest(r, digest, timeout=net.request_timeout, standing=standing),
            net.request_timeout + 5,
        )
        deadline = time.monotonic() + max(5.0, net.round_timeout)
        signed: dict[str, dict[str, str]] = {}
        while not self.stop_event.is_set():
            expected = self.live_peers() | self._heard()
            try:
                signed = self.transport.run(
                    catchup.attested(
                        self.transport, self.cfg.run.run_id, r, timeout=net.request_timeout
                    ),
                    net.request_timeout + 5,
                )
            except (ProtocolError, TimeoutError) as exc:
                logger.info("round %d: signed states unreadable: %s", r, exc)
            signers = {p for who in signed.values() for p in who}
            if expected <= signers or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        target = swarm_state(signed)
        if target is None or target == digest:
            logger.info("round %d: this node's state is the swarm's", r)
            return digest
        holders = sorted(p for p, s in signed[target].items() if s != "joining")
        while not self.stop_event.is_set():
            if self._catch_up(min_round=r, rebase=True, digest=target, holders=holders):
                logger.warning("round %d: took the swarm's state from a peer", r)
                return self.state_server.publish(self._snapshot())
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        logger.warning("round %d: could not take the swarm's state from any peer", r)
        return digest

    def _catch_up(
        self,
        min_round: int,
        rebase: bool = False,
        digest: str | None = None,
        holders: list[str] | None = None,
    ) -> bool:
        """Take the newest global state from a live peer at ``min_round`` or later (with
        ``digest``: that state, from ``holders``).

        With ``rebase`` this node's unsynced local work is kept: each fragment's local
        copy moves by the same amount as its global copy, so the work is contributed at
        the next sync instead of being thrown away.
        """
        assert self.transport is not None and self.peers is not None
        net = self.cfg.network
        self._pull_from_site()
        self.transport.run(self.peers.refresh(self._record()), net.request_timeout * 2 + 5)
        found = catchup.download(
            self.transport,
            self.identity,
            catchup_settings(self.cfg),
            self.peers.sources(min_round) if holders is None else self.peers.among(holders),
            self.plan,
            min_round=min_round,
            signers=max(1, min(self.cfg.trust.state_signers, len(self.peers.live()))),
            digest=digest,
        )
        if found is None:
            return False
        snap, sources = found
        before = [self.outer.global_vector(f) for f in range(len(self.plan))]
        snap.apply(self.outer)
        for f in range(len(self.plan)):
            if rebase:
                self.outer.rebase_local(self.model, f, before[f])
            else:
                self.outer.sync_local(self.model, f)
                self.feedback[f].reset()
        self.round = max(self.round, snap.round)
        self._site_changed = True
        # Follow the swarm's place in the inner learning-rate schedule: a newcomer at
        # its warmup peak would take steps far larger than everyone else's.
        self.trainer.steps = max(self.trainer.steps, snap.steps)
        self.events.write("catch_up", round=self.round, sources=sources)
        return True

    def _agree_clock(self) -> SecondsClock:
        """The run's round clock (:func:`node.clock.agree`)."""
        assert self.transport is not None
        settings = clock_settings(
            self.cfg,
            self.spec_digest,
            len(self.plan),
            self.initial_peers,
            self.spec.t0 if self.spec is not None else None,
        )
        net = self.cfg.network
        agreeing = agree_clock(self.transport, self.identity, settings)
        return self.transport.run(agreeing, settings.wait + 4 * net.request_timeout + 10)

    def _wait_for_peers(self) -> None:
        net = self.cfg.network
        deadline = time.monotonic() + net.min_peers_timeout
        while len(self.live_peers()) + 1 < net.min_peers and not self.stop_event.is_set():
            if time.monotonic() > deadline:
                logger.warning(
                    "only %d of %d peers after %.0fs; training anyway",
                    len(self.live_peers()) + 1,
                    net.min_peers,
                    net.min_peers_timeout,
                )
                break
            time.sleep(0.2)

    def _teardown(self, quiet: bool = False) -> None:
        """Stop what was started, in order; never raises, so the error that ended the
        node (a read-only or full disk, say) is the one reported, not a second one.

        Args:
            quiet: the node is ending on an error: what fails here too is logged at
                debug level only.
        """

        def attempt(what: str, step: Any) -> None:
            try:
                step()
            except Exception as exc:
                logger.log(logging.DEBUG if quiet else logging.WARNING, "%s failed: %s", what, exc)
                logger.debug("%s failed", what, exc_info=True)

        if self.site_group is not None and not self.stop_event.is_set():
            # on a signal torchrun stops the ranks itself; on an error they are told here
            attempt("taking the site's last values", self._pull_from_site)
            attempt("stopping the site's ranks", self.site_group.stop)
        if hasattr(self, "outer") and self.round > 0:
            attempt("final checkpoint", self._checkpoint)
        if getattr(self, "monitor", None) is not None:
            attempt("stopping the metrics endpoint", self.monitor.close)
        if self.control is not None:
            attempt("closing the control channel", self.control.close)
        if self.transport is not None:
            attempt("stopping the transport", self.transport.shutdown)
        if hasattr(self, "state_server"):
            attempt("closing the served state", self.state_server.close)
        if hasattr(self, "verifier"):
            attempt("closing the audit log", self.verifier.close)
        if hasattr(self, "status"):
            stopped = {"force": True, "state": "stopped", "round": self.round}
            attempt("writing the final status", lambda: self.status.update(**stopped))
        if self.site_group is not None:
            attempt("closing the site's process group", self.site_group.close)
        if hasattr(self, "events"):
            attempt("logging the stop", lambda: self.events.write("stop", round=self.round))
            attempt("closing the event log", self.events.close)

    # ---- training -------------------------------------------------------------------------

    def _train(self) -> None:
        self.status.update(force=True, state="training")
        self.train_started = time.monotonic()
        if self.site_group is not None:
            # the ranks start from the leader's state (resumed or taken from the swarm)
            self.site_group.share_optimizer(self.trainer.optimizer)
        if self.cfg.sync.trigger == "steps":
            self._train_steps()
        else:
            self._train_seconds()
        if self.site_group is not None and not self.stop_event.is_set():
            self._pull_from_site()  # the final checkpoint holds what the ranks trained
            self.site_group.stop()  # on a signal, torchrun stops the ranks itself
        self._linger()

    def _linger(self) -> None:
        """After the last round, stay reachable while a live peer is still behind
        (bounded by how long its last sync may take): a peer whose last sync failed
        re-syncs from the swarm's state, and it can only take it from running nodes."""
        if self.stop_event.is_set() or not self.cfg.run.max_rounds:
            return
        net = self.cfg.network
        # as long as a lagging peer's last sync can take (see _apply), and no longer
        deadline = time.monotonic() + net.matchmaking_seconds + 3 * net.round_timeout
        self.status.update(force=True, state="lingering", round=self.round)
        while time.monotonic() < deadline and not self.stop_event.is_set():
            if self.peers is None or not self.peers.behind(self.round):
                return
            time.sleep(0.5)

    def _step(self, tokens_since: list[int]) -> None:
        """One inner step, stretched by ``run.slowdown``; counts busy time."""
        started = time.monotonic()
        if self.site_group is None:
            result = self.trainer.step()
        else:
            self._share_with_site()
            self.site_group.step(self.trainer.steps)
            result = self.site_group.guard(self.trainer.step)  # DDP all-reduces in it
            self._shards_ahead = self.site_group.sharded
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

    def _share_with_site(self) -> None:
        """The site's ranks take the leader's parameters if they changed since the last
        inner step (a sync applied, a re-sync, a catch-up)."""
        assert self.site_group is not None
        if self._site_changed:
            self.site_group.share_params(self.model, self.site_module)
            self._site_changed = False

    def _sharded(self) -> bool:
        return self.site_group is not None and self.site_group.sharded

    def _pull_from_site(self) -> None:
        """Under FSDP, before the node reads its model: the full values of the shards."""
        group = self.site_group
        if group is None or not self._shards_ahead or self.stop_event.is_set():
            return  # after a signal torchrun is stopping the ranks: nothing to gather from
        if not (group.stopped or group.broken):
            group.gather(self.model, self.site_module)
            self._shards_ahead = False

    def _launch(self, r: int, f: int, tokens: int) -> Pending:
        """Start the sync of fragment ``f`` for round ``r`` with the tokens trained for it."""
        self._pull_from_site()
        self.verifier.round = max(self.verifier.round, r)
        # Wait for every live peer, suspects included: they count in everyone's view of
        # the round, and whether they are left out is decided by vote (voted_out).
        expected = self.live_peers()
        excludes = self.verifier.excluded(list(expected), r)
        budget = self._exchange_budget()
        return self.syncer.launch(r, f, tokens, self.trainer.steps, expected, excludes, budget)

    def _exchange_budget(self) -> float:
        """Seconds one exchange may take: matchmaking, the commit phase and the all-reduce
        (``network.round_timeout``); on the wall clock, never past the fragment's next
        sync, so a silent or vanished peer cannot make an exchange outlast its round."""
        cfg = self.cfg
        budget = cfg.network.matchmaking_seconds + cfg.network.round_timeout
        if cfg.control.commit:
            window = self.control.commit_window if self.control else cfg.control.commit_seconds
            budget += window
        if cfg.sync.trigger == "seconds":
            length = cfg.sync.round_seconds
            budget = min(budget, length - max(0.5, 0.05 * length))
        return budget

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
                    pending.append(self._launch(r, f, tokens_since[f]))
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
        run = _WallRun(tokens_since=[0] * fragments)
        self._place(run)
        while not self.stop_event.is_set():
            if cfg.run.max_rounds and self.round >= cfg.run.max_rounds:
                break
            self._step(run.tokens_since)
            if clock.round_at(time.time()) - self.round > _BEHIND_ROUNDS:
                self._fell_behind(run)  # frozen, suspended or cut off for a while
            for r, f in clock.due(time.time(), run.last):
                run.last = (r, f)
                if r < self.join_round or f in run.pending:
                    # Joining, or the previous sync of f is still in flight: skip this one;
                    # the work stays in the local copy and is folded into the next sync.
                    run.skip(r, f, self.syncer)
                    continue
                run.pending[f] = self._launch(r, f, run.tokens_since[f])
                run.tokens_since[f] = 0
            for f, p in list(run.pending.items()):
                if p.future.done() and self.trainer.steps - p.step >= cfg.sync.tau:
                    del run.pending[f]
                    if self._apply(p) is None:
                        run.failed.add(p.round)
                    run.done.setdefault(p.round, set()).add(f)
            while run.done.get(self.round + 1, set()) >= set(range(fragments)):
                r = self.round + 1
                run.done.pop(r)
                self._end_round(r, resync=r in run.failed or r < self.join_round)
        for p in run.pending.values():
            p.future.cancel()

    def _place(self, run: _WallRun) -> None:
        """Where this node comes in on the wall clock, from the state round it holds."""
        clock, fragments = self.clock, len(self.plan)
        in_progress = clock.round_at(time.time())
        run.last = (self.round, fragments - 1)
        if self.round < in_progress - 1:
            # Behind the swarm (joining, back from a restart or a freeze): sit out the
            # round in progress, training all the same, and re-sync from a peer when it
            # ends; the work done meanwhile is rebased onto the swarm's state and
            # contributed from the next round.
            self.join_round = in_progress + 1
            self.events.write(
                "join", round=in_progress, state_round=self.round, contributes_from=self.join_round
            )
            self.round = in_progress - 1
            run.last = (self.round, fragments - 1)
        elif self.round == in_progress - 1:
            # Current, but the round has begun: contribute from the first fragment whose
            # matchmaking is still ahead; the ones already under way are skipped (their
            # work goes into the next sync) and the round is re-synced when it ends.
            lead = self.cfg.network.matchmaking_seconds
            now = time.time()
            ahead = [f for f in range(fragments) if clock.sync_time(in_progress, f) - lead > now]
            first = ahead[0] if ahead else fragments
            if first > 0:
                for f in range(first):
                    run.skip(in_progress, f, self.syncer)
                run.last = (in_progress, first - 1)
                self.events.write(
                    "join", round=in_progress, state_round=self.round, from_fragment=first
                )

    def _fell_behind(self, run: _WallRun) -> None:
        """Rounds went by without this node (it was frozen, suspended or cut off): drop
        what is in flight, take the swarm's newest state, keeping the local work, and
        come in again as a joining node does. Parts it sent late were refused by their
        owners at no cost to it."""
        behind = self.clock.round_at(time.time()) - self.round
        logger.warning("%d rounds behind the swarm's clock: re-joining", behind)
        self.events.write("behind", round=self.round, rounds=behind)
        for p in run.pending.values():
            p.future.cancel()
        run.pending.clear()
        run.done.clear()
        run.failed.clear()
        self._catch_up(min_round=self.round + 1, rebase=True)
        self._place(run)

    def _apply(self, pending: Pending) -> dict[str, Any] | None:
        """Apply a finished sync; None when it failed or averaged alone while peers live."""
        self._pull_from_site()
        record = self.syncer.apply(pending, self.trainer.steps)
        self._site_changed = True
        if record is None:
            return None
        self.bytes_sent += record["bytes_sent"]
        self.status.update(peers=len(record["group"]), bytes_sent=self.bytes_sent)
        others = self.live_peers() | self._heard()
        if len(record["group"]) == 1 and others:
            # peers are live (in the registry, or heard on the control channel): this
            # node is cut off from their exchanges; it takes their state at round end
            self.alone_syncs += 1
            warning = (
                f"round {pending.round} fragment {pending.fragment}: averaged alone while "
                f"{len(others)} peer(s) are live"
            )
            logger.warning("%s", warning)
            self.status.update(alone_syncs=self.alone_syncs, alone_warning=warning)
            return None
        if record["fallback_parts"] and self.live_peers():
            # Parts kept at local values drift from the swarm: take its state at round end.
            return None
        return record

    def _end_round(self, r: int, resync: bool) -> None:
        self.round = r
        self._pull_from_site()
        mixing = self.exchange.settings.mixes(len(self.live_peers()) + 1)
        apart = None if mixing else self.agreement.check(r)
        if apart is not None:
            logger.warning("round %d: %s: taking the swarm's state", r, apart)
            resync = True
        digest = self.state_server.publish(self._snapshot())
        if resync and mixing:
            # Global copies differ across the swarm by design: there is no one state to
            # take; the next rounds' mixing pulls this node's copy back in.
            logger.info("round %d: no re-sync while groups mix weights", r)
        elif resync and (self.live_peers() or self._heard()):
            digest = self._take_swarm_state(r, digest, joining=r < self.join_round)
        self._global_digest = (self.round, digest)
        self.agreement.own(self.round, digest)
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
        fields["live_peers"] = len(self.live_peers())
        fields["load"] = self.load.sample()
        fields.update(memory_per_param(self.plan.numel, self.device))
        if self.site_group is not None:
            self._share_with_site()
            digests = self.site_group.digests(self.site_module)
            agree = len(set(digests)) == 1
            if self.site_group.sharded:  # and the shards make up the leader's full copy
                agree = agree and digests[0] == params_digest(self.model)
            fields.update(ranks=len(digests), ranks_agree=agree)
            if not fields["ranks_agree"]:
                logger.error("round %d: the ranks of this site hold different parameters", r)
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

    def _snapshot(self) -> catchup.StateSnapshot:
        # the live tensors: publish copies them into its replies before anything steps
        return catchup.StateSnapshot.take(
            self.round, self.plan.digest(), self.outer, self.trainer.steps, copy_tensors=False
        )

    def _evaluate_global(self) -> float:
        """Validation bits per byte of the global parameters (what the swarm agreed on)."""
        return evaluate(
            self.model,
            self.val_batches,
            self.device,
            self.bytes_per_token,
            params=self.outer.global_params(),
        )

    def _checkpoint(self) -> None:
        if getattr(self, "_checkpointed_round", None) == self.round:
            return
        self._checkpointed_round = self.round
        self._pull_from_site()
        # the audit rows and standings of the rounds in the checkpoint go to disk first
        if not self.verifier.flush():
            logger.warning("audit log: queued rows not written within 30 s of a checkpoint")
        signed = self._global_digest or (None, "")
        state = {
            "round": self.round,
            "run_id": self.cfg.run.run_id,
            # the digest of this round's global state, as peers attest it (atoll export)
            "global_digest": signed[1] if signed[0] == self.round else "",
            "plan": self.plan.digest(),
            "layout": [[list(f.names), [list(s) for s in f.shapes]] for f in self.plan.fragments],
            "model": self.model.state_dict(),
            # written before anything steps again: the live tensors, not a second copy
            "outer": self.outer.state_dict(copy_tensors=False),
            # under FSDP each rank holds the state of its own shard: not kept
            "inner": None if self._sharded() else self.trainer.optimizer.state_dict(),
            "steps": self.trainer.steps,
            "tokens": self.trainer.tokens,
            "workload": self.workload,
        }
        info = save_checkpoint(
            self.data_dir / "checkpoints", self.round, state, keep=self.cfg.run.keep_checkpoints
        )
        self._checkpoint_time = time.time()
        self.events.write("checkpoint", round=self.round, file=info.path.name, digest=info.digest)

    # ---- peers ----------------------------------------------------------------------------

    def live_peers(self) -> set[str]:
        """Peers of this run and spec whose registry record is fresh (this node excluded)."""
        return self.peers.live() if self.peers is not None else set()

    def _heard(self) -> set[str]:
        """Peers of this run whose heartbeats the control channel hears now (another view
        of who is live than the registry's, over other connections)."""
        if self.control is None:
            return set()
        heard = self.control.heard()
        return {p for p, info in heard.items() if info.get("spec") == self.spec_digest}

    def _control_traffic(self) -> dict[str, int]:
        channel = self.control.channel if self.control is not None else None
        return channel.stats().get("traffic", {}) if channel is not None else {}

    def _helper_pids(self) -> list[int]:
        """Processes this node started besides itself (p2pd, DHT, control sidecar)."""
        pids = list(self.transport.helper_pids) if self.transport else []
        if self.control is not None and self.control.sidecar_pid:
            pids.append(self.control.sidecar_pid)
        return pids

    def _start_monitor(self) -> None:
        """The metrics endpoint, when ``[metrics] port`` is set."""
        self.monitor: Monitor | None = None
        m = self.cfg.metrics
        if m.port is None:
            return
        try:
            self.monitor = Monitor(m.host, m.port, self.monitor_state)
        except OSError as exc:
            raise ValueError(
                f"metrics.port = {m.port} on {m.host}: {exc.strerror or exc}; choose another "
                "port (0: any free one)"
            ) from exc
        port = self.monitor.start()
        url = f"http://{m.host}:{port}"
        self.status.update(force=True, metrics_url=url)
        logger.info("metrics on %s/metrics, state on %s/api/v1/state", url, url)

    def monitor_state(self) -> dict[str, Any]:
        """One snapshot of this node for the metrics endpoint (called from its threads)."""
        state: dict[str, Any] = dict(self.status.current)
        state.update(version=__version__, run_id=self.cfg.run.run_id)
        state.update({k: v for k, v in self._vitals().items() if k in ("throughput", "step")})
        allreduce = getattr(self, "allreduce", None)
        if allreduce is not None:
            state.update(
                bytes_sent=allreduce.bytes_sent,
                bytes_received=allreduce.bytes_received,
                refused=dict(allreduce.rejected),
            )
        syncer = getattr(self, "syncer", None)
        if syncer is not None:
            state["syncs"] = dict(syncer.outcomes)
        swarm = state.get("swarm") or {}
        if swarm:
            state.update(
                control_peers=len(swarm.get("peers", {})),
                sidecar_restarts=swarm.get("sidecar_restarts", 0),
                control_dropped=dict(swarm.get("dropped") or {}),
            )
        if getattr(self, "_checkpoint_time", None) is not None:
            state["checkpoint_age_seconds"] = time.time() - self._checkpoint_time
        # for the health page: bits/byte per round and recent violations, from the log
        events = recent_events(self.data_dir / "events.jsonl")
        state["history"] = [
            [e["round"], e["val_bpb"]]
            for e in events
            if e.get("event") == "round" and isinstance(e.get("val_bpb"), (int, float))
        ]
        state["violations"] = [e for e in events if e.get("event") == "violation"][-20:]
        state["initial_reputation"] = INITIAL_SCORE
        return state

    def _vitals(self) -> dict[str, Any]:
        """What this node's heartbeats say about it."""
        trainer = getattr(self, "trainer", None)
        tokens = trainer.tokens if trainer else 0
        reachability = self.transport.reachability if self.transport else None
        return {
            "round": self.round,
            "step": trainer.steps if trainer else 0,
            "throughput": round(tokens / self.busy, 1) if self.busy > 0 else 0.0,
            "device": str(getattr(self, "device", "")),
            "reachable": reachability.reachable if reachability else True,
            "spec": self.spec_digest,
            # the global state after the last round, which peers compare with theirs
            "digest": list(self._global_digest) if self._global_digest else None,
        }

    def _record(self) -> Any:
        assert self.peers is not None
        trainer = getattr(self, "trainer", None)
        control = self.control.addrs if self.control else ()
        return self.peers.record(self.round, trainer.steps if trainer else 0, control)

    async def _registry_loop(self) -> None:
        """Refresh this node's registry record and its view of the swarm when due (every
        ``registry_seconds``, less often in a large swarm: :attr:`PeerView.interval`);
        take operator commands and report every ``registry_seconds``, forever."""
        assert self.transport is not None and self.peers is not None
        net = self.cfg.network
        checked = False
        while not self.stop_event.is_set():
            if self.peers.due():
                await self.peers.refresh(self._record())
            if self.peers.conflict is not None:
                self.stop_event.set()  # another process runs with this key: stop
                return
            live = self.peers.live()
            if self.control is not None:
                self.control.resize(len(live) + 1)
            if not checked and live and self.transport.reachability.status == "unknown":
                # The first node of a swarm had nobody to ask at start.
                checked = True
                found = await self.transport.check_reachability(sorted(live)[:3])
                logger.info("%s", found.summary())
            if self.control is not None:
                records = self.peers.records
                # a peer nobody can dial dials us instead
                self.control.dial({p: records[p].control for p in live if records[p].reachable})
            self._take_operator_commands()
            self._report(live)
            await asyncio.sleep(net.registry_seconds)

    def _take_operator_commands(self) -> None:
        """Apply ``atoll ban`` / ``atoll pardon`` commands queued in the data directory."""
        try:
            if self.admin.poll():
                self.status.update(flagged=self.verifier.flagged(self.round))
        except OSError as exc:  # an unreadable admin folder must not stop the node
            logger.warning("operator commands: %s", exc)

    def _operator(self, command: Command) -> dict[str, Any]:
        standing = self.verifier.operator(command.op, command.peer, command.reason)
        if command.op == "pardon" and self.control is not None:
            self.control.pardoned(command.peer)  # new proof of a new offence counts again
        return standing

    def _report(self, live: set[str]) -> None:
        """Peers, reachability and warnings into the status file."""
        assert self.transport is not None and self.peers is not None
        for peer, reason in {**self.peers.refused(), **self.syncer.refused}.items():
            if peer not in self._refused:
                logger.warning("peer %s refused: %s", peer, reason)
                self.events.write("peer_refused", peer=peer, reason=reason)
            self._refused[peer] = reason
        fields: dict[str, Any] = {
            "live_peers": len(live),
            "refused_peers": dict(self._refused),
            "reachability": self.transport.reachability.to_dict(),
            "data_plane": {
                "mode": self.transport.config.data_plane,
                "port": self.transport.data_port,
                "calls": dict(self.transport.calls_by_plane),
            },
            "reputations": self.verifier.reputations(),
            "helper_pids": self._helper_pids(),
        }
        if self.control is not None:
            for peer, info in self.control.heard().items():
                self.agreement.heard(peer, info.get("digest"))
            swarm = self.control.swarm()
            fields.update(control_addrs=self.control.addrs, swarm=swarm)
            warning = self.control.silence(live)
            if warning and self._warned_at + 60 < time.monotonic():
                self._warned_at = time.monotonic()
                logger.error("%s", warning)
            fields["control_warning"] = warning
        self.status.update(**fields)
