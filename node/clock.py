"""When fragments sync: after H inner steps (``steps``) or on the swarm's wall clock (``seconds``).

In ``seconds`` mode the swarm shares a round clock: a start time ``t0`` and a round
length ``T``. Round ``r`` (1-based) spans ``[t0 + (r-1)T, t0 + rT)`` and fragment
``f`` of ``F`` syncs at ``t0 + (r-1)T + (f+1)T/F``, so fragment syncs are spread
evenly across the round and the link carries a steady stream. Every node syncs at the
same wall time with whatever it trained since its last sync, weighted by tokens; no
node waits for another.

How the clock is agreed (:func:`agree`): a run spec carries ``t0`` and its clock is the
run's. Without one, the first node of a run stores a signed manifest
``{t0, round_seconds, spec}`` in the DHT under ``{run_id}:manifest``; every later node
with the same shared settings reads it and uses the same numbers (the earliest
manifest of those settings wins over local config; other settings' are ignored).
Clocks are assumed synchronised to NTP level (tens of milliseconds): skew shifts
when a node announces a sync by that much, and the matchmaking window
(``network.matchmaking_seconds``) absorbs it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.wire.messages import Header, open_envelope, seal
from verification.identity import Identity

__all__ = ["SecondsClock", "agree"]

logger = logging.getLogger(__name__)

_MANIFEST_BYTES = 4096
_MANIFEST_SECONDS = 7 * 86400.0
_POLL_SECONDS = 0.5


@dataclass
class SecondsClock:
    """Wall-clock rounds of ``round_seconds`` starting at ``t0`` (unix time)."""

    t0: float
    round_seconds: float
    fragments: int

    def sync_time(self, round_: int, fragment: int) -> float:
        """Unix time at which fragment ``fragment`` of round ``round_`` syncs."""
        return (
            self.t0
            + (round_ - 1) * self.round_seconds
            + ((fragment + 1) * self.round_seconds / self.fragments)
        )

    def round_at(self, now: float) -> int:
        """The round in progress at ``now`` (0 before ``t0``)."""
        if now < self.t0:
            return 0
        return int(math.floor((now - self.t0) / self.round_seconds)) + 1

    def due(self, now: float, after: tuple[int, int]) -> list[tuple[int, int]]:
        """Every ``(round, fragment)`` after ``after`` whose sync time has passed."""
        out = []
        r, f = after
        while True:
            f += 1
            if f >= self.fragments:
                r, f = r + 1, 0
            if r < 1 or self.sync_time(r, f) > now:
                return out
            out.append((r, f))

    def next_boundary(self, after: tuple[int, int]) -> tuple[int, int]:
        """The sync that follows ``after``."""
        r, f = after
        return (r, f + 1) if f + 1 < self.fragments else (r + 1, 0)

    @staticmethod
    def start_time(round_seconds: float, lead: float = 2.0) -> float:
        """A ``t0`` a little in the future, on a whole second, for a new swarm."""
        return math.ceil(time.time() + lead)


def _key(run_id: str) -> str:
    return f"{run_id}:manifest"


async def _read(
    transport: Transport, run_id: str, spec: str, timeout: float
) -> tuple[float, float, str] | None:
    """The earliest valid manifest of ``run_id`` and ``spec``: ``(t0, length, signer)``."""
    found = await transport.dht_get(_key(run_id), timeout=timeout, kind="clock")
    clocks = []
    for signer, value in found.items() if isinstance(found, dict) else []:
        try:
            env = open_envelope(
                value,
                max_bytes=_MANIFEST_BYTES,
                expected_sender=signer,
                run_id=run_id,
                kinds=("manifest",),
            )
            t0, length = env.body.get("t0"), env.body.get("round_seconds")
            if env.body.get("spec", "") != spec:
                raise ProtocolError("spec_mismatch", "a manifest of other shared settings")
            if isinstance(t0, float) and isinstance(length, float) and length > 0:
                clocks.append((t0, length, signer))
        except ProtocolError as exc:
            logger.info("manifest under %s refused: %s", signer[:16], exc)
    return min(clocks) if clocks else None


async def agree(
    transport: Transport,
    identity: Identity,
    run_id: str,
    spec: str,
    round_seconds: float,
    fragments: int,
    *,
    spec_t0: float | None = None,
    wait: float = 0.0,
    lead: float = 2.0,
    timeout: float = 10.0,
) -> SecondsClock:
    """The run's round clock.

    Args:
        spec: digest of the run spec (or shared settings) this node runs.
        spec_t0: the run spec's ``t0``: when given, it is the clock, and the DHT is
            not consulted.
        wait: how long to look for another node's manifest before starting a clock
            (0 for the first node of a swarm).
        lead: how far ahead of now a new clock starts.
        timeout: deadline of one DHT operation.
    """
    if spec_t0 is not None:
        logger.info("round clock from the run spec: t0 %.1f", spec_t0)
        return SecondsClock(spec_t0, round_seconds, fragments)
    deadline = time.monotonic() + wait
    while True:
        found = await _read(transport, run_id, spec, timeout)
        if found is not None:
            t0, length, signer = found
            logger.info("round clock from %s: t0 %.1f, %.1fs rounds", signer[:16], t0, length)
            return SecondsClock(t0, length, fragments)
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(_POLL_SECONDS)
    t0 = float(SecondsClock.start_time(round_seconds, lead=lead))
    body = {"t0": t0, "round_seconds": float(round_seconds), "spec": spec}
    header = Header("manifest", run_id, 0, 0, 0, identity.peer_id)
    await transport.dht_store(
        _key(run_id),
        identity.peer_id,
        seal(identity, header, body),
        _MANIFEST_SECONDS,
        timeout=timeout,
        kind="clock",
    )
    logger.info("started the round clock: t0 %.1f, %.1fs rounds", t0, round_seconds)
    return SecondsClock(t0, round_seconds, fragments)
