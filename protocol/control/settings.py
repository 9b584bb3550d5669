"""The control plane's settings: its channel's sidecar, and how often and how widely it speaks.

Built once from a node's ``[control]`` table (:func:`node.settings.control_settings`);
the channel takes :class:`ChannelSettings`, the plane :class:`ControlSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.control.frames import DEFAULT_MAX_CONTROL_BYTES, MAX_CONTROL_BYTES

__all__ = ["ChannelSettings", "ControlSettings"]


@dataclass(frozen=True)
class ChannelSettings:
    """How a node's control channel runs its sidecar process.

    Attributes:
        key_file: the node's libp2p private-key file (see
            :meth:`~verification.identity.Identity.save`); the sidecar loads the same key.
        run: the run id; messages of other runs are refused.
        max_bytes: the cap on one control message, sent or received, in
            ``[1024, MAX_CONTROL_BYTES]``.
        restart: whether to restart the sidecar when it dies.
        listen_host: the IP address to listen on (``0.0.0.0``: every interface).
        port: the TCP port to listen on; 0 picks a free one (and a restarted sidecar
            reuses the port picked first, where it can).
        announce_maddrs: where peers should dial the sidecar, when that differs from
            where it listens (a forwarded port on a public address).
        ready_timeout: seconds to wait for the sidecar to be ready.
        max_age_s: when set, refuse messages whose timestamp is further than this from
            the local clock.
        log_path: file the sidecar's log is appended to; its stderr is this process's
            stderr when None.
    """

    key_file: Path | str
    run: str
    max_bytes: int = DEFAULT_MAX_CONTROL_BYTES
    restart: bool = True
    listen_host: str = "127.0.0.1"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()
    ready_timeout: float = 30.0
    max_age_s: float | None = None
    log_path: Path | None = None

    def __post_init__(self) -> None:
        if not 1024 <= self.max_bytes <= MAX_CONTROL_BYTES:
            raise ValueError(
                f"max_bytes must be in [1024, {MAX_CONTROL_BYTES}], got {self.max_bytes}"
            )


@dataclass(frozen=True)
class ControlSettings:
    """Heartbeats, commitments and dialling of one node's control plane.

    Attributes:
        channel: the channel's sidecar (its ``run`` is the plane's run).
        heartbeat_seconds: seconds between two heartbeats in a swarm of up to
            ``base_rate_peers`` nodes.
        commit: whether the node's exchanges commit to their parts first (the node
            hands :attr:`ControlPlane.commitments` to its all-reduce); named in the
            warning of a deaf channel.
        commit_seconds: longest wait for a group's commitments, in a swarm of up to
            ``base_rate_peers`` nodes.
        dial_peers: peers whose sidecars a node dials.
        base_rate_peers: swarm size above which heartbeats and the commit phase stretch
            by ``n / base_rate_peers`` and commitments are no longer gossiped.
    """

    channel: ChannelSettings
    heartbeat_seconds: float = 1.0
    commit: bool = True
    commit_seconds: float = 2.0
    dial_peers: int = 8
    base_rate_peers: int = 8

    @property
    def run_id(self) -> str:
        """The run every message is signed for."""
        return self.channel.run

    @property
    def max_bytes(self) -> int:
        """The cap on one control message, also on a commitment sent directly."""
        return self.channel.max_bytes
