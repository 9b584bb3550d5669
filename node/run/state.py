"""What a running node holds, built once by :mod:`node.build` and read by its loop, its
round's end and its reports: :class:`Progress` (where its training stands, with the
node's :class:`~verification.rounds.RoundClock`), :class:`Training` (what trains),
:class:`Network` (what talks to the swarm) and :class:`NetworkInputs` (what the swarm
side is built from besides the config and the transport), and :class:`Running` (what
the loop and a round's end share).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.checks import UsefulWork
from node.checks.trace import Tracer
from node.run.admin import AdminInbox
from node.run.load import LoadMeter
from node.run.metrics import EventLog, StatusWriter
from node.run.syncer import Syncer
from node.swarm.peers import PeerView
from node.train.deadlines import Deadlines
from node.train.outer import OuterOptimizer
from node.train.site_leader import NoSite, SiteLeader
from node.train.trainer import InnerTrainer, evaluate
from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.exchange import FragmentExchange
from protocol.averaging.fragments import FragmentPlan
from protocol.catchup import StateSnapshot
from protocol.control.plane import ControlPlane
from protocol.p2p.transport import Transport
from protocol.stateserver import StateServer
from protocol.wire.feedback import ErrorFeedback
from verification.identity import Identity
from verification.rounds import RoundClock
from verification.verifier import Verifier

__all__ = ["Network", "NetworkInputs", "Progress", "Running", "Training", "control_traffic"]


def _process_start() -> float:
    """When this process started (``time.time``): its age from ``/proc`` (ticks since
    boot, to 10 ms), else now."""
    import os

    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # pragma: no cover - no /proc
        return time.time()
    return time.time() - max(0.0, age)


@dataclass
class Progress:
    """Where a node's training stands.

    Attributes:
        clock: the node's round clock, which every layer reads (:attr:`round`: the last
            round this node finished).
        busy: seconds spent in inner steps.
        bytes_sent: bytes this node's syncs sent.
        alone_syncs: syncs averaged alone while peers were live.
        exchanges: syncs whose group held another peer.
        last_exchange: the round of the newest of them (0: none yet).
        launched: when this process started (``time.time``).
        first_exchange: seconds from ``launched`` to the first exchange (None: none yet).
        catch_ups: global states taken from peers (joining, or after a round that went
            wrong).
        catch_up_bytes: bytes of those states (values and momentum).
        catch_up_seconds: seconds spent downloading and checking them.
        train_started: when training began (``time.monotonic``).
        global_digest: ``(round, digest)`` of the global state last published.
        checkpointed_round: the round of the newest checkpoint written by this process.
        checkpoint_time: when it was written (``time.time``).
    """

    clock: RoundClock = field(default_factory=RoundClock)
    busy: float = 0.0
    bytes_sent: int = 0
    alone_syncs: int = 0
    exchanges: int = 0
    last_exchange: int = 0
    launched: float = field(default_factory=_process_start)
    first_exchange: float | None = None
    catch_ups: int = 0
    catch_up_bytes: int = 0
    catch_up_seconds: float = 0.0
    train_started: float = field(default_factory=time.monotonic)
    global_digest: tuple[int, str] | None = None
    checkpointed_round: int | None = None
    checkpoint_time: float | None = None

    @property
    def round(self) -> int:
        """The last round this node finished."""
        return self.clock.ended


@dataclass
class Training:
    """What trains: built by :func:`build_training`.

    Attributes:
        device: where inner steps run.
        model: the node's model (in CPU memory under FSDP, the shards on the devices).
        plan: its fragments.
        outer: global copies, outer momentum and the outer step.
        trainer: inner steps.
        feedback: each fragment's codec and error-feedback residual.
        val_batches: the validation windows.
        tokens: the run's train and validation tokens, whole (useful-work checks draw any
            member's batches from them).
        bytes_per_token: of the validation text, for bits per byte.
        workload: what a checkpoint needs to be exported and sampled elsewhere.
        site: the site's ranks (:class:`~node.train.site_leader.SiteLeader`), or :class:`~node.train.site_leader.NoSite`.
    """

    device: torch.device
    model: nn.Module
    plan: FragmentPlan
    outer: OuterOptimizer
    trainer: InnerTrainer
    feedback: list[ErrorFeedback]
    val_batches: list[Any]
    tokens: tuple[torch.Tensor, torch.Tensor]
    bytes_per_token: float
    workload: dict[str, Any]
    site: SiteLeader | NoSite

    def evaluate_global(self) -> float:
        """Validation bits per byte of the global parameters (what the swarm agreed on)."""
        return evaluate(
            self.model,
            self.val_batches,
            self.device,
            self.bytes_per_token,
            params=self.outer.global_params(),
        )

    def snapshot(self, round_: int) -> StateSnapshot:
        """The global state of ``round_`` to serve to peers (the live tensors: publishing
        copies them into its replies before anything steps)."""
        return self.outer.snapshot(
            round_, self.plan.digest(), self.trainer.steps, copy_tensors=False
        )


@dataclass
class Network:
    """What talks to the swarm: started by :func:`start_network`."""

    transport: Transport
    peers: PeerView
    hearing: Callable[[], set[str]]
    verifier: Verifier
    admin: AdminInbox
    control: ControlPlane | None
    allreduce: AllReduceService
    exchange: FragmentExchange
    syncer: Syncer
    deadlines: Deadlines
    checks: UsefulWork | None
    state_server: StateServer
    load: LoadMeter
    tracer: Tracer | None = None
    """This node's trace of its training (``trust.replay_steps``), served to checkers."""

    def live_peers(self) -> set[str]:
        """Peers of this run and spec whose registry record is fresh (this node excluded)."""
        return self.peers.live()

    def heard(self) -> set[str]:
        """Peers heard on the control channel now (:class:`Hearing`)."""
        return self.hearing()

    def record(self, round_: int, steps: int) -> Any:
        """This node's registry record."""
        control = self.control.addrs if self.control else ()
        return self.peers.record(round_, steps, control)

    def helper_pids(self) -> list[int]:
        """Processes this node started besides itself (p2pd, DHT, control sidecar)."""
        pids = list(self.transport.helper_pids)
        if self.control is not None and self.control.sidecar_pid:
            pids.append(self.control.sidecar_pid)
        return pids

    def control_traffic(self) -> dict[str, int]:
        return control_traffic(self.control)


def control_traffic(control: ControlPlane | None) -> dict[str, int]:
    """Bytes and messages by kind on the control channel so far."""
    channel = control.channel if control is not None else None
    return channel.stats().get("traffic", {}) if channel is not None else {}


@dataclass(frozen=True)
class NetworkInputs:
    """What :func:`start_network` takes besides the config and the started transport."""

    identity: Identity
    data_dir: Path
    spec_digest: str
    initial_peers: tuple[str, ...]
    byzantine: str | None
    version: str
    clock: RoundClock


@dataclass
class Running:
    """What the loop and a round's end share: the node's records, its logs and its stop.

    Attributes:
        progress: where the training stands (its round moves here).
        training: the model, its optimizers and the site.
        network: the swarm side.
        status: the status file.
        events: the event log.
        stop: set when the node is stopping.
    """

    progress: Progress
    training: Training
    network: Network
    status: StatusWriter
    events: EventLog
    stop: threading.Event
