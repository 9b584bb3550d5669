"""Catching up: serve this node's last completed global state, and take a peer's.

At the end of every round a node snapshots its global copy of every fragment and
the outer optimizer's momentum. A node that joins (or falls behind) asks a peer of
the newest round for that snapshot over the ``atoll.state`` RPC; the reply is a
signed envelope whose round, fragment plan and sizes are checked before anything is
loaded. Momentum travels as raw float32 bytes, never pickled; optimizers without a
``momentum_buffer`` start their state afresh on the joining node.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from node.outer import OuterOptimizer
from protocol.errors import ProtocolError
from protocol.messages import Header, open_envelope, seal
from protocol.transport import Transport
from verification.identity import Identity

__all__ = ["StateServer", "StateSnapshot", "fetch_state"]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.state"


@dataclass(frozen=True)
class StateSnapshot:
    """Global values and outer momentum of every fragment after ``round``."""

    round: int
    plan_digest: str
    globals: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor | None, ...]
    steps: int = 0

    @classmethod
    def take(
        cls, round_: int, plan_digest: str, outer: OuterOptimizer, steps: int = 0
    ) -> StateSnapshot:
        momentum = []
        for opt in outer.optimizers:
            buf = next(iter(opt.state.values()), {}).get("momentum_buffer")
            momentum.append(None if buf is None else buf.detach().clone())
        return cls(
            round=round_,
            plan_digest=plan_digest,
            globals=tuple(outer.global_vector(f) for f in range(len(outer.globals))),
            momentum=tuple(momentum),
            steps=steps,
        )

    def apply(self, outer: OuterOptimizer) -> None:
        """Load into ``outer`` (globals and, where present, momentum)."""
        for f, value in enumerate(self.globals):
            outer.set_global(f, value)
            buf = self.momentum[f]
            if buf is not None:
                opt, param = outer.optimizers[f], outer.globals[f]
                opt.state[param]["momentum_buffer"] = buf.clone()


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().float().contiguous().cpu().numpy().tobytes()


class StateServer:
    """Serves the newest snapshot to peers that ask."""

    def __init__(self, transport: Transport, identity: Identity, run_id: str) -> None:
        self.transport = transport
        self.identity = identity
        self.run_id = run_id
        self._lock = threading.Lock()
        self._reply: bytes | None = None
        self._round = -1

    def register(self) -> None:
        self.transport.add_handler(RPC_NAME, self._handle, max_request_bytes=4096)

    def publish(self, snapshot: StateSnapshot) -> None:
        """Make ``snapshot`` the state served from now on."""
        body = {
            "plan": snapshot.plan_digest,
            "steps": int(snapshot.steps),
            "globals": [_to_bytes(g) for g in snapshot.globals],
            "momentum": [None if m is None else _to_bytes(m) for m in snapshot.momentum],
        }
        header = Header("state", self.run_id, snapshot.round, 0, 0, self.identity.peer_id)
        reply = seal(self.identity, header, body)
        with self._lock:
            self._reply, self._round = reply, snapshot.round

    async def _handle(self, peer: str, data: bytes) -> bytes:
        open_envelope(
            data, max_bytes=4096, expected_sender=peer, run_id=self.run_id, kinds=("state_req",)
        )
        with self._lock:
            reply = self._reply
        if reply is None:
            raise ProtocolError("no_state", "this node has no completed round yet", peer)
        return reply


async def fetch_state(
    transport: Transport,
    identity: Identity,
    run_id: str,
    peer: str,
    *,
    plan_digest: str,
    sizes: list[int],
    min_round: int,
    timeout: float,
    max_bytes: int,
) -> StateSnapshot:
    """Ask ``peer`` for its snapshot and check it against this node's model.

    Raises:
        ProtocolError: unreachable peer, bad signature, another run or model, wrong
            sizes, non-finite values, or a round older than ``min_round``.
    """
    request = seal(identity, Header("state_req", run_id, 0, 0, 0, identity.peer_id), {})
    reply = await transport.call(
        peer, RPC_NAME, request, timeout=timeout, max_response_bytes=max_bytes
    )
    env = open_envelope(
        reply, max_bytes=max_bytes, expected_sender=peer, run_id=run_id, kinds=("state",)
    )
    if env.header.round < min_round:
        raise ProtocolError("stale_round", f"state of round {env.header.round} < {min_round}", peer)
    body = env.body
    if body.get("plan") != plan_digest:
        raise ProtocolError("wrong_model", "the peer's fragment plan differs from ours", peer)
    raw_globals, raw_momentum = body.get("globals"), body.get("momentum")
    if not (isinstance(raw_globals, list) and isinstance(raw_momentum, list)):
        raise ProtocolError("malformed", "globals and momentum must be lists", peer)
    if len(raw_globals) != len(sizes) or len(raw_momentum) != len(sizes):
        raise ProtocolError("malformed", "wrong number of fragments", peer)
    globals_, momentum = [], []
    for f, size in enumerate(sizes):
        globals_.append(_tensor(raw_globals[f], size, peer))
        momentum.append(None if raw_momentum[f] is None else _tensor(raw_momentum[f], size, peer))
    steps = body.get("steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ProtocolError("malformed", "steps must be a non-negative integer", peer)
    logger.info("took the global state of round %d from %s", env.header.round, peer[:16])
    return StateSnapshot(env.header.round, plan_digest, tuple(globals_), tuple(momentum), steps)


def _tensor(raw: object, size: int, peer: str) -> torch.Tensor:
    if not isinstance(raw, bytes) or len(raw) != size * 4:
        raise ProtocolError("malformed", f"expected {size * 4} bytes of float32", peer)
    t = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ProtocolError("not_finite", "state holds NaN or inf", peer)
    return t
