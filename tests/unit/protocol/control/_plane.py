"""A control plane without a network, and the signed messages the plane's tests deliver to it."""

from __future__ import annotations

import asyncio
import time

from protocol.control.commitments import _Commit
from protocol.control.frames import open_control, sign_control, topic_name
from protocol.control.plane import ControlPlane
from protocol.wire.messages import Header
from protocol.wire.partwire import open_part, seal_part
from verification.identity import Identity

RUN = "unit"
ME = Identity.from_seed(b"m" * 32)
CHEAT = Identity.from_seed(b"c" * 32)
OTHER = Identity.from_seed(b"o" * 32)
D1, D2 = b"\x01" * 32, b"\x02" * 32


def signed_message(identity: Identity, topic: str, body: object, seq: int = 1) -> bytes:
    return sign_control(identity, RUN, topic_name(RUN, topic), seq, body)


def commitment(
    identity: Identity,
    digests: dict[int, bytes],
    round_: int = 3,
    seq: int = 1,
    content: str = "update",
) -> bytes:
    body = {
        "round": round_,
        "fragment": 0,
        "content": content,
        "digests": [[j, d] for j, d in digests.items()],
    }
    return signed_message(identity, "commit", body, seq)


class DirectTransport:
    """What the plane asks of a transport: it sends each commitment through ``send``."""

    def __init__(self, send) -> None:
        self.send = send

    def add_handler(self, *args, **kwargs) -> None:
        pass

    async def call(self, peer: str, name: str, data: bytes, timeout: float) -> bytes:
        return await self.send(peer, data, timeout)


def check_part(cp: ControlPlane, *args) -> str | None:
    return asyncio.run(cp.commitments.check(*args))


def deliver(cp: ControlPlane, topic: str, wire: bytes) -> None:
    full = topic_name(RUN, topic)
    cp._on_message(full, open_control(wire, RUN, full))


def result_evidence(
    owner: Identity,
    contributors: list[str],
    digests: list[bytes],
    part: int = 1,
    content: str = "update",
    commits: list[bytes] | None = None,
) -> bytes:
    """The evidence of a signed result: its head and signature (the body is not needed)."""
    meta = {
        "content": content,
        "contributors": contributors,
        "digests": digests,
        "weights": [1.0] * len(digests),
        **({"commits": commits} if commits is not None else {}),
    }
    header = Header("reduced", RUN, 3, 0, part, owner.peer_id)
    sealed = seal_part(owner, header, meta, bytes(4 * 1024)).to_bytes()
    return open_part(sealed, max_bytes=2**20).evidence()


def own_commitment(plane: ControlPlane, digests: dict[int, bytes]) -> bytes:
    """This node's commitment, signed and recorded as publish_commit would."""
    wire = commitment(ME, digests)
    plane.commitments._commits[(ME.peer_id, 3, 0, "update")] = _Commit(
        dict(digests), time.monotonic(), wire
    )
    return wire
