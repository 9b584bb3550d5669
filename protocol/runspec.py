"""Serving a run's signed spec to peers that ask (RPC ``atoll.spec``).

Every node that runs from a signed run spec serves its text, so a volunteer who has a
run address (``RUN_ID@/ip4/.../p2p/<PeerID>``, printed by ``atoll spec create``) fetches
the spec from the swarm itself instead of from a file passed around. The reply is the
spec's bytes as they are; this layer trusts nothing in them: the caller verifies the
signature against the operator's PeerID it was given (:mod:`node.swarm.join`)::

    request  = run id (UTF-8, at most 64 bytes)
    response = the spec file's bytes (TOML, at most MAX_SPEC_BYTES)

A node that runs another run (or none) answers ``wrong_run``.
"""

from __future__ import annotations

from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport

__all__ = ["MAX_SPEC_BYTES", "RPC_NAME", "SpecServer", "fetch_spec_bytes"]

RPC_NAME = "atoll.spec"
MAX_SPEC_BYTES = 256 * 1024
"""The largest spec served or accepted (a spec is a few KiB of TOML)."""
_MAX_RUN_ID_BYTES = 256  # 64 characters of up to 4 UTF-8 bytes


class SpecServer:
    """Answers ``atoll.spec`` with this node's run spec.

    Args:
        transport: where peers ask.
        run_id: the run the spec is for; a request for another run is refused.
        text: the spec file's bytes.

    Raises:
        ValueError: ``text`` is larger than :data:`MAX_SPEC_BYTES`.
    """

    def __init__(self, transport: Transport, run_id: str, text: bytes) -> None:
        if len(text) > MAX_SPEC_BYTES:
            raise ValueError(f"run spec of {len(text)} bytes: at most {MAX_SPEC_BYTES} are served")
        self.transport = transport
        self.run_id = run_id
        self.text = bytes(text)
        self.served = 0
        """Requests answered with the spec."""

    def register(self) -> None:
        self.transport.add_handler(RPC_NAME, self._handle, max_request_bytes=_MAX_RUN_ID_BYTES)

    async def _handle(self, peer: str, data: bytes) -> bytes:
        try:
            asked = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("malformed", "the run id is not UTF-8", peer) from None
        if asked != self.run_id:
            raise ProtocolError("wrong_run", f"this node runs {self.run_id!r}, not {asked!r}", peer)
        self.served += 1
        return self.text


async def fetch_spec_bytes(transport: Transport, peer: str, run_id: str, timeout: float) -> bytes:
    """Ask ``peer`` for the spec of ``run_id``; the bytes it sent, unverified.

    Raises:
        ProtocolError: the peer could not be reached, runs another run (``remote_error``
            naming it), or sent more than :data:`MAX_SPEC_BYTES` (``oversized``).
    """
    request = run_id.encode("utf-8")
    if len(request) > _MAX_RUN_ID_BYTES:
        raise ProtocolError("malformed", f"run id of {len(request)} bytes", peer)
    return await transport.call(
        peer, RPC_NAME, request, timeout=timeout, max_response_bytes=MAX_SPEC_BYTES
    )
