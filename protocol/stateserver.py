"""Serving this node's last completed global state, and signing its digest.

At the end of every round a node hands its snapshot
(:class:`protocol.catchup.StateSnapshot`) to :meth:`StateServer.publish`, which writes
it into a file it serves from (no second copy in memory), and signs the snapshot's
digest into the DHT with its standing (:meth:`StateServer.attest`). Peers that catch
up ask for it over the ``atoll.state`` RPC, a chunk of a fragment at a time
(:mod:`protocol.catchup` takes it).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from protocol import catchup
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.wire.messages import Header, open_envelope, seal
from verification.identity import Identity

__all__ = ["StateServer"]


@dataclass(frozen=True)
class _Served:
    """The snapshot a node serves: its values in a file of its own, read on request."""

    round: int
    plan_digest: str
    steps: int
    digest: str
    fd: int
    layout: tuple[tuple[int, int, int | None], ...]  # per fragment: values, offset, momentum's


class StateServer:
    """Serves the newest snapshot, in chunks of a fragment, to peers that ask.

    The snapshot's values are written to a file in ``folder`` (float32, each fragment's
    global values and then its momentum) and read back chunk by chunk as peers ask, so
    serving costs the node no memory per parameter; the file of the previous round is
    removed once a newer one is served.

    Args:
        transport: where peers ask (``atoll.state``).
        identity: signs every chunk.
        run_id: the run's id.
        folder: where the state file lives (a node's data directory's ``state``).
    """

    def __init__(self, transport: Transport, identity: Identity, run_id: str, folder: Path) -> None:
        self.transport = transport
        self.identity = identity
        self.run_id = run_id
        self.folder = Path(folder)
        self._lock = threading.Lock()
        self._served: _Served | None = None
        self._retired: _Served | None = None  # kept open for requests still reading it
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("state-*.bin"):  # left by an earlier run
            stale.unlink(missing_ok=True)

    def register(self) -> None:
        self.transport.add_handler(catchup.RPC_NAME, self._handle, max_request_bytes=4096)

    def publish(self, snapshot: catchup.StateSnapshot) -> str:
        """Serve ``snapshot`` from now on; return its digest."""
        digest = catchup.state_digest(snapshot.globals)
        path = self.folder / f"state-{snapshot.round:08d}.bin"
        tmp = path.with_suffix(".tmp")
        layout, offset = [], 0
        with tmp.open("wb") as f:
            for value, m in zip(snapshot.globals, snapshot.momentum):
                n = value.numel()
                f.write(catchup.raw_bytes(value))
                moment = None
                if m is not None:
                    moment = offset + 4 * n
                    f.write(catchup.raw_bytes(m))
                layout.append((n, offset, moment))
                offset += 4 * n * (1 if m is None else 2)
        os.replace(tmp, path)
        served = _Served(
            snapshot.round,
            snapshot.plan_digest,
            int(snapshot.steps),
            digest,
            os.open(path, os.O_RDONLY),
            tuple(layout),
        )
        path.unlink()  # the open descriptor keeps it readable; nothing is left behind
        with self._lock:
            retired, self._retired, self._served = self._retired, self._served, served
        if retired is not None:
            os.close(retired.fd)
        return digest

    def close(self) -> None:
        """Stop serving and let go of the state files."""
        with self._lock:
            served = [s for s in (self._served, self._retired) if s is not None]
            self._served = self._retired = None
        for s in served:
            os.close(s.fd)

    async def attest(
        self, round_: int, digest: str, *, timeout: float, standing: str = "settled"
    ) -> bool:
        """Sign ``digest`` as this node's global state after ``round_``, in the DHT (a
        later signature for the same round replaces it).

        Args:
            standing: one of :data:`protocol.catchup.STANDINGS`: ``settled`` (the round
                went well), ``unsettled`` (this node lost a sync of the round and is about
                to take the swarm's state), ``joining`` (its state is not the swarm's yet:
                it says it is here, and its digest is never taken).
        """
        if standing not in catchup.STANDINGS:
            raise ValueError(
                f"standing {standing!r}: expected one of {', '.join(catchup.STANDINGS)}"
            )
        header = Header("digest", self.run_id, round_, 0, 0, self.identity.peer_id)
        value = seal(self.identity, header, {"digest": digest, "standing": standing})
        return await self.transport.dht_store(
            catchup.digest_key(self.run_id, round_),
            self.identity.peer_id,
            value,
            3600.0,
            timeout=timeout,
            kind="digest",
        )

    async def _handle(self, peer: str, data: bytes) -> bytes:
        env = open_envelope(
            data, max_bytes=4096, expected_sender=peer, run_id=self.run_id, kinds=("state_req",)
        )
        with self._lock:
            served = self._served
        if served is None:
            raise ProtocolError("no_state", "this node has no completed round yet", peer)
        f, c = env.header.fragment, env.header.part
        if not 0 <= f < len(served.layout):
            raise ProtocolError("wrong_part", f"no fragment {f}", peer)
        n, offset, moment = served.layout[f]
        count = max(1, -(-n // catchup.CHUNK_VALUES))
        if not 0 <= c < count:
            raise ProtocolError("wrong_part", f"no chunk {c} of fragment {f}", peer)
        lo, hi = c * catchup.CHUNK_VALUES, min(n, (c + 1) * catchup.CHUNK_VALUES)
        body = {
            "plan": served.plan_digest,
            "steps": served.steps,
            "digest": served.digest,
            "chunks": count,
            "global": os.pread(served.fd, 4 * (hi - lo), offset + 4 * lo),
            "momentum": None
            if moment is None
            else os.pread(served.fd, 4 * (hi - lo), moment + 4 * lo),
        }
        header = Header("state", self.run_id, served.round, f, c, self.identity.peer_id)
        return seal(self.identity, header, body)
