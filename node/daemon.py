"""One node's life: start, join, catch up, train with fragment syncs, checkpoint, leave.

:meth:`Node.run` reads top to bottom. The node wires the parts together and runs the
lifecycle; the parts do the work: :mod:`node.ops.startup` (data directory, key, transport,
metrics endpoint, the run's clock), :mod:`node.build` (the training side and the swarm
side, each built by one builder), :class:`~node.run.loop.TrainingLoop` (inner steps and
syncs over a schedule), :class:`~node.run.rounds.Rounds` (a round's end, catching up,
checkpoints) and :mod:`node.ops.reporter` (status, metrics, the registry's upkeep).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path

from node.build import build_training, start_network
from node.config import AtollConfig
from node.ops.keyfile import load_identity
from node.ops.monitor import Monitor
from node.ops.reporter import Reporter, Upkeep, __version__
from node.ops.startup import (
    Teardown,
    install_signals,
    open_logs,
    run_clock,
    start_monitor,
    start_transport,
    wait_for_peers,
)
from node.run.loop import schedule_of
from node.run.metrics import EventLog, StatusWriter
from node.run.rounds import Rounds
from node.run.state import Network, NetworkInputs, Progress, Running, Training
from node.settings import loop_settings, round_settings
from node.spec import RunSpec, settings_digest, version_line
from node.spec_file import spec_text
from node.swarm.byzantine import make_behaviour
from node.swarm.peers import DuplicateIdentityError
from node.train.agreement import AgreementWatch
from node.train.bindings import bind
from node.train.site import SiteRank
from protocol.p2p.transport import Transport
from protocol.runspec import SpecServer

__all__ = ["Node", "PastLastRound", "TrainedAlone", "__version__"]

logger = logging.getLogger(__name__)


class TrainedAlone(ValueError):
    """A node that joined a run ran all its rounds without exchanging with a peer."""


class PastLastRound(ValueError):
    """A node starts (from its checkpoint or the swarm's state) at or past its last round."""


class Node:
    """A training node. Construct with a validated config, then call :meth:`run`.

    Every part is None until :meth:`run` builds it; :meth:`_teardown` stops the parts
    that exist, so a node that failed half-way through its start stops cleanly.

    Args:
        cfg: the node's configuration (with a run spec's shared settings applied).
        initial_peers: multiaddrs to join through (overrides ``network.initial_peers``).
        byzantine: a fault-injection mode (tests and benchmarks only); None is honest.
        spec: the signed run spec this node joins (:mod:`node.spec`), if any: its
            digest is announced, and its clock is the run's clock.
        site: this process's rank when the node is a site (:mod:`node.train.site`).
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
        make_behaviour(byzantine)  # an unknown mode fails before anything starts
        if byzantine == "split" and cfg.sync.exchange != "gather":
            raise ValueError("--byzantine split attacks a gather: set sync.exchange = 'gather'")
        self.cfg = cfg
        self.site = site
        self.byzantine = byzantine
        self.spec = spec
        self.spec_digest = spec.digest if spec is not None else settings_digest(cfg)
        self.initial_peers = initial_peers or cfg.network.initial_peers
        self.data_dir = Path(cfg.run.data_dir).expanduser()
        self.stop_event = threading.Event()
        self.progress = Progress()
        self.agreement = AgreementWatch()  # this node's global digest against its peers'
        self.logs: tuple[StatusWriter, EventLog] | None = None
        self.reporter: Reporter | None = None
        self.monitor: Monitor | None = None
        self.training: Training | None = None
        self.transport: Transport | None = None
        self.network: Network | None = None
        self.rounds: Rounds | None = None

    @property
    def round(self) -> int:
        """The last round this node finished."""
        return self.progress.round

    def run(self) -> int:
        """Run until ``run.max_rounds`` rounds are done or SIGINT/SIGTERM; return an exit code.

        Raises:
            DuplicateIdentityError: another running node uses this node's key.
            TrainedAlone: it joined through initial peers and ran ``run.max_rounds``
                rounds without one exchange with a peer.
            PastLastRound: it starts at or past ``run.max_rounds``.
            ValueError: a start-up problem the operator can fix (data directory,
                identity key, corpus, listen port), told in one line with the fix.
            OSError: a file in the data directory could not be written (a full disk).
        """
        install_signals(self.stop_event)
        failed = True
        try:
            running, rounds = self._setup()
            network = running.network
            self._check_rounds_left()
            wait_for_peers(self.cfg, network.live_peers, self.stop_event)
            clock = None
            if self.cfg.sync.trigger == "seconds":
                fragments = len(rounds.training.plan)
                spec = (self.spec_digest, self.initial_peers, self.spec.t0 if self.spec else None)
                clock = run_clock(
                    self.cfg, network.transport, network.peers.identity, fragments, spec
                )
            loop = loop_settings(self.cfg).build(running, rounds)
            loop.run(schedule_of(self.cfg, self.progress.round, clock))
            if network.peers.conflict:
                raise DuplicateIdentityError(network.peers.conflict)
            self._check_not_alone(network)
            failed = False
            return 0
        finally:
            self._teardown(quiet=failed)

    def _check_rounds_left(self) -> None:
        """``run.max_rounds`` is the run's round at which a node stops, not a count of its
        own rounds: a node that starts at or past it (a volunteer joining a swarm further
        on, or a node restarted after its last round) has nothing to train.

        Raises:
            PastLastRound: as above, saying how to go on.
        """
        last, at = self.cfg.run.max_rounds, self.progress.round
        if last and at >= last:
            source = "the swarm's state" if self.initial_peers else "its checkpoint"
            raise PastLastRound(
                f"this node starts at round {at} ({source}), at or past its last round "
                f"(run.max_rounds = {last}, --rounds): nothing to train; --rounds counts the "
                f"run's rounds, so give more than {at}, or 0 to train until stopped"
            )

    def _check_not_alone(self, network: Network) -> None:
        """A node that joined through initial peers (or a spec's bootstrap) and ran all
        its rounds without one exchange with a peer did not take part in the run: an
        error, so that scripts and supervisors see it (a node that starts a swarm and
        is never joined only warns, see :meth:`TrainingLoop._alone`).

        Raises:
            TrainedAlone: as above.
        """
        max_rounds, progress = self.cfg.run.max_rounds, self.progress
        if self.stop_event.is_set() or not self.initial_peers or not max_rounds:
            return
        if progress.round < max_rounds or progress.exchanges > 0:
            return
        refused = network.peers.refused()
        why = (
            f"; {len(refused)} peer(s) refused as on another spec (atoll status lists them)"
            if refused
            else "; check the initial peers (or the spec's bootstrap) and this node's network"
        )
        raise TrainedAlone(
            f"trained {progress.round} round(s) without one exchange with a peer: its work "
            f"reached no one{why}"
        )

    def _setup(self) -> tuple[Running, Rounds]:
        """Open the data directory, build the training side, start the swarm side,
        resume or catch up, and evaluate the starting point."""
        cfg, progress = self.cfg, self.progress
        status, events = self.logs = open_logs(cfg, self.data_dir)
        replaced = None if self.spec is None else version_line(self.spec)
        if replaced:
            logger.info("%s", replaced)
            events.write("spec_version", line=replaced, versions=len(self.spec.chain()))
        key_file = self.data_dir / "identity.key"
        identity = load_identity(key_file)
        spec_file = self.spec is not None
        status.update(force=True, state="starting", pid=os.getpid(), peer_id=identity.peer_id)
        status.update(force=True, run_id=cfg.run.run_id, spec=self.spec_digest, spec_file=spec_file)
        reporter = self.reporter = Reporter(
            cfg.run.run_id, self.spec_digest, progress, status, self.data_dir
        )
        self.monitor = start_monitor(cfg, reporter.monitor_state, status)
        training = self.training = reporter.training = build_training(
            cfg, identity.peer_id, self.site, self.byzantine
        )
        # A bootstrap node joining its own run spec finds itself among the initial peers.
        mine = f"/p2p/{identity.peer_id}"
        self.initial_peers = tuple(m for m in self.initial_peers if not m.endswith(mine))
        stop = self.stop_event
        transport = start_transport(cfg, key_file, identity, self.initial_peers, stop, status)
        self.transport = transport
        inputs = NetworkInputs(
            identity,
            self.data_dir,
            self.spec_digest,
            self.initial_peers,
            self.byzantine,
            __version__,
            self.progress.clock,
        )
        network = start_network(cfg, transport, inputs, training, events, reporter.vitals)
        self.network = reporter.network = network
        if self.spec is not None:  # joiners with the run's address fetch it from any node
            SpecServer(transport, self.spec.run_id, spec_text(self.spec).encode()).register()
        status.update(
            force=True,
            reachability=transport.reachability.to_dict(),
            maddrs=transport.maddrs,
            relayed=any("/p2p-circuit" in m for m in transport.maddrs),
            params=training.plan.numel,
            ranks=self.site.world if self.site is not None else 1,
            helper_pids=network.helper_pids(),
        )
        running = Running(progress, training, network, status, events, stop)
        rounds = round_settings(cfg, self.data_dir).build(running, self.agreement)
        self.rounds = rounds
        rounds.resume()
        if self.initial_peers:
            rounds.resync.catch_up(min_round=progress.round + 1)
        network.state_server.publish(rounds.snapshot())
        upkeep = Upkeep(network, training, reporter, events, self.agreement, stop)
        transport.submit(upkeep.run()).add_done_callback(self._upkeep_ended)
        val_bpb_start = training.evaluate_global()
        status.update(force=True, state="ready", round=progress.round, val_bpb_start=val_bpb_start)
        return running, rounds

    def _upkeep_ended(self, ended: Future[str | None]) -> None:
        """The upkeep ended: with a reason to stop (another process runs with this
        node's key, :attr:`PeerView.conflict`), the node stops; :meth:`run` then says why."""
        if not ended.cancelled() and ended.exception() is None and ended.result() is not None:
            self.stop_event.set()

    def _teardown(self, quiet: bool = False) -> None:
        """Stop what was started, in order; never raises, so the error that ended the
        node (a read-only or full disk, say) is the one reported, not a second one.

        Args:
            quiet: the node is ending on an error: what fails here too is logged at
                debug level only.
        """
        attempt = Teardown(quiet)
        training, network, rounds = self.training, self.network, self.rounds
        if training is not None and not self.stop_event.is_set():
            # on a signal torchrun stops the ranks itself; on an error they are told here
            attempt("taking the site's last values", lambda: training.site.pull(stopping=False))
            attempt("stopping the site's ranks", training.site.stop)
        if rounds is not None and self.progress.round > 0:
            attempt("final checkpoint", rounds.checkpoint)
        if self.monitor is not None:
            attempt("stopping the metrics endpoint", self.monitor.close)
        if network is not None and network.checks is not None:
            attempt("stopping the useful-work checks", network.checks.close)
        if network is not None and network.tracer is not None:
            attempt("removing the trace's spilled states", network.tracer.close)
        if network is not None and network.control is not None:
            attempt("closing the control channel", network.control.close)
        if self.transport is not None:
            attempt("stopping the transport", self.transport.shutdown)
        if network is not None:
            attempt("closing the served state", network.state_server.close)
            attempt("closing the audit log", network.verifier.close)
        if self.logs is None:
            return
        status, events = self.logs
        stopped = {"force": True, "state": "stopped", "round": self.progress.round}
        attempt("writing the final status", lambda: status.update(**stopped))
        if training is not None:
            attempt("closing the site's process group", training.site.close)
        attempt("logging the stop", lambda: events.write("stop", round=self.progress.round))
        attempt("closing the event log", events.close)
