"""What a node says about itself: its status file, its metrics snapshot, the vitals its
heartbeats carry; and its upkeep every ``network.registry_seconds`` (registry record,
view of the swarm, dialling, operator commands, report).

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
from node.train.agreement import AgreementWatch
from protocol.p2p.relays import CIRCUIT
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
    size and dial the control plane, take operator commands, and report.

    Args:
        network: the swarm side.
        training: what trains (its step count goes into the registry record).
        reporter: the status and vitals.
        events: the event log.
        agreement: this node's global digest against its peers' (fed with theirs).
        stop: set to stop the node (another process runs with its key).
        registry_seconds: the pace of the loop.
    """

    def __init__(
        self,
        network: Network,
        training: Training,
        reporter: Reporter,
        events: EventLog,
        agreement: AgreementWatch,
        stop: threading.Event,
        registry_seconds: float,
    ) -> None:
        self.network = network
        self.training = training
        self.reporter = reporter
        self.events = events
        self.agreement = agreement
        self.stop = stop
        self.registry_seconds = registry_seconds
        self.refused: dict[str, str] = {}  # peers refused during this run, and why
        self.warned_at = -1e9

    async def run(self) -> None:
        """The loop, until the node stops."""
        network, progress = self.network, self.reporter.progress
        peers, control = network.peers, network.control
        checked = False
        while not self.stop.is_set():
            if peers.due():
                steps = self.training.trainer.steps
                await peers.refresh(network.record(progress.round, steps))
            if peers.conflict is not None:
                self.stop.set()  # another process runs with this key: stop
                return
            live = peers.live()
            if control is not None:
                control.resize(len(live) + 1)
            if not checked and live and network.transport.reachability.status == "unknown":
                # The first node of a swarm had nobody to ask at start.
                checked = True
                found = await network.transport.check_reachability(sorted(live)[:3])
                logger.info("%s", found.summary())
            await self.relays(live)
            if control is not None:
                records = peers.records
                # a peer nobody can dial dials us instead
                control.dial({p: records[p].control for p in live if records[p].reachable})
            self.take_operator_commands()
            self.report(live)
            await asyncio.sleep(self.registry_seconds)

    async def relays(self, live: set[str]) -> None:
        """Behind NAT with ``network.relay_parts``: claim this node's circuits once it
        holds a relay's slot; and connect to live peers that own parts through a relay
        (:mod:`protocol.p2p.relays`), so calls to them go through it."""
        transport, records = self.network.transport, self.network.peers.records
        waiting = transport.config.relay_parts and transport.reachability.status == "private"
        if waiting and (await transport.claim_relays()).status == "relayed":
            self.reporter.status.update(maddrs=transport.maddrs, relayed=True)
        reachable = [records[p] for p in sorted(live) if p in records and records[p].reachable]
        wanted = {r.peer: list(r.maddrs) for r in reachable if any(CIRCUIT in m for m in r.maddrs)}
        await transport.reach(wanted)

    def take_operator_commands(self) -> None:
        """Apply ``atoll ban`` / ``atoll pardon`` commands queued in the data directory."""
        try:
            if self.network.admin.poll():
                flagged = self.network.verifier.flagged(self.reporter.progress.round)
                self.reporter.status.update(flagged=flagged)
        except OSError as exc:  # an unreadable admin folder must not stop the node
            logger.warning("operator commands: %s", exc)

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
            for peer, info in control.heard().items():
                self.agreement.heard(peer, info.get("digest"))
            fields.update(control_addrs=control.addrs, swarm=control.swarm())
            warning = control.silence(live)
            if warning and self.warned_at + 60 < time.monotonic():
                self.warned_at = time.monotonic()
                logger.error("%s", warning)
            fields["control_warning"] = warning
        self.reporter.status.update(**fields)
