"""What a node says about itself: its status file, its metrics snapshot, the vitals its
heartbeats carry; and its upkeep every ``network.registry_seconds`` (registry record,
view of the swarm, dialling through :mod:`node.swarm.dialer`, operator commands, peers'
digests for the agreement watch, report).

A node's parts come up in stages (its data directory, its model, its network), and the
metrics endpoint answers from the first: :class:`Reporter` reports what exists so far.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
import time
from pathlib import Path
from typing import Any

from node.run.metrics import EventLog, StatusWriter, recent_events
from node.run.state import Network, Progress, Training
from node.swarm.dialer import Dialer
from node.train.agreement import AgreementWatch
from verification.reputation import INITIAL_SCORE

__all__ = ["Reporter", "Upkeep", "__version__"]

logger = logging.getLogger(__name__)

try:
    __version__ = importlib.metadata.version("atoll")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"


class Reporter:
    """The node's status, metrics snapshot and vitals.

    Args:
        run_id: the run.
        spec_digest: the run spec's digest (or the settings'), which peers compare.
        progress: where the training stands.
        status: the status file.
        data_dir: the node's data directory (its event log feeds the health page).
    """

    def __init__(
        self,
        run_id: str,
        spec_digest: str,
        progress: Progress,
        status: StatusWriter,
        data_dir: Path,
    ) -> None:
        self.run_id = run_id
        self.spec_digest = spec_digest
        self.progress = progress
        self.status = status
        self.events_file = data_dir / "events.jsonl"
        self.training: Training | None = None  # once built
        self.network: Network | None = None  # once started

    def monitor_state(self) -> dict[str, Any]:
        """One snapshot of this node for the metrics endpoint (called from its threads)."""
        state: dict[str, Any] = dict(self.status.current)
        state.update(version=__version__, run_id=self.run_id)
        state.update({k: v for k, v in self.vitals().items() if k in ("throughput", "step")})
        if self.network is not None:
            allreduce = self.network.allreduce
            state.update(
                bytes_sent=allreduce.context.bytes_sent,
                bytes_received=allreduce.context.bytes_received,
                refused=dict(allreduce.context.rejected),
            )
            state["syncs"] = dict(self.network.syncer.outcomes)
        swarm = state.get("swarm") or {}
        if swarm:
            state.update(
                control_peers=len(swarm.get("peers", {})),
                sidecar_restarts=swarm.get("sidecar_restarts", 0),
                control_dropped=dict(swarm.get("dropped") or {}),
            )
        state["exchange_budget_seconds"] = (state.get("deadlines") or {}).get("exchange_seconds")
        if self.progress.checkpoint_time is not None:
            state["checkpoint_age_seconds"] = time.time() - self.progress.checkpoint_time
        # for the health page: bits/byte per round and recent violations, from the log
        events = recent_events(self.events_file)
        state["history"] = [
            [e["round"], e["val_bpb"]]
            for e in events
            if e.get("event") == "round" and isinstance(e.get("val_bpb"), (int, float))
        ]
        state["violations"] = [e for e in events if e.get("event") == "violation"][-20:]
        state["initial_reputation"] = INITIAL_SCORE
        return state

    def vitals(self) -> dict[str, Any]:
        """What this node's heartbeats say about it."""
        trainer = self.training.trainer if self.training is not None else None
        tokens = trainer.tokens if trainer else 0
        busy = self.progress.busy
        reachability = self.network.transport.reachability if self.network else None
        digest = self.progress.global_digest
        return {
            "round": self.progress.round,
            "step": trainer.steps if trainer else 0,
            "throughput": round(tokens / busy, 1) if busy > 0 else 0.0,
            "device": str(self.training.device) if self.training is not None else "",
            "reachable": reachability.reachable if reachability else True,
            "spec": self.spec_digest,
            # the global state after the last round, which peers compare with theirs
            "digest": list(digest) if digest else None,
        }


class Upkeep:
    """Every ``network.registry_seconds``: refresh this node's registry record and view
    of the swarm when due (less often in a large swarm: :attr:`PeerView.interval`),
    dial the live peers (:class:`~node.swarm.dialer.Dialer`), take operator commands,
    hand the digests peers announced to the agreement watch, and report.

    :meth:`run` ends when the node stops, or with the reason the node must stop (another
    process runs with its key), which the node acts on.

    Args:
        network: the swarm side.
        training: what trains (its step count goes into the registry record).
        reporter: the status and vitals.
        events: the event log.
        agreement: this node's global digest against its peers' (fed with theirs).
        stop: set when the node stops.
    """

    def __init__(
        self,
        network: Network,
        training: Training,
        reporter: Reporter,
        events: EventLog,
        agreement: AgreementWatch,
        stop: threading.Event,
    ) -> None:
        self.network = network
        self.training = training
        self.reporter = reporter
        self.events = events
        self.agreement = agreement
        self.stop = stop
        relayed = self._relayed
        self.dialer = Dialer(network.transport, network.peers, network.control, relayed)
        self.refused: dict[str, str] = {}  # peers refused during this run, and why
        self.warned_at = -1e9

    async def run(self) -> str | None:
        """The loop, until the node stops (None) or must stop (why)."""
        network, progress = self.network, self.reporter.progress
        peers = network.peers
        while not self.stop.is_set():
            if peers.due():
                steps = self.training.trainer.steps
                await peers.refresh(network.record(progress.round, steps))
            if peers.conflict is not None:
                return peers.conflict
            live = peers.live()
            await self.dialer.dial(live)
            self.take_operator_commands()
            self.hear_digests()
            self.report(live)
            await asyncio.sleep(peers.settings.registry_seconds)
        return None

    def _relayed(self, maddrs: list[str]) -> None:
        self.reporter.status.update(maddrs=maddrs, relayed=True)

    def take_operator_commands(self) -> None:
        """Apply ``atoll ban`` / ``atoll pardon`` commands queued in the data directory."""
        try:
            if self.network.admin.poll():
                flagged = self.network.verifier.flagged(self.reporter.progress.round)
                self.reporter.status.update(flagged=flagged)
        except OSError as exc:  # an unreadable admin folder must not stop the node
            logger.warning("operator commands: %s", exc)

    def hear_digests(self) -> None:
        """Hand the global digests peers' heartbeats carry to the agreement watch."""
        control = self.network.control
        if control is None:
            return
        for peer, info in control.heard().items():
            self.agreement.heard(peer, info.get("digest"))

    def report(self, live: set[str]) -> None:
        """Peers, reachability and warnings into the status file."""
        network = self.network
        transport, control = network.transport, network.control
        for peer, reason in {**network.peers.refused(), **network.syncer.refused}.items():
            if peer not in self.refused:
                logger.warning("peer %s refused: %s", peer, reason)
                self.events.write("peer_refused", peer=peer, reason=reason)
            self.refused[peer] = reason
        fields: dict[str, Any] = {
            "live_peers": len(live),
            "refused_peers": dict(self.refused),
            "reachability": transport.reachability.to_dict(),
            "data_plane": {
                "mode": transport.config.data_plane,
                "port": transport.data_port,
                "calls": dict(transport.calls_by_plane),
            },
            "reputations": network.verifier.reputations(),
            "helper_pids": network.helper_pids(),
        }
        if control is not None:
            fields.update(control_addrs=control.addrs, swarm=control.swarm())
            warning = control.silence(live)
            if warning and self.warned_at + 60 < time.monotonic():
                self.warned_at = time.monotonic()
                logger.error("%s", warning)
            fields["control_warning"] = warning
        self.reporter.status.update(**fields)
