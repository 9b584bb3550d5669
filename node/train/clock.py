"""When fragments sync: after H inner steps (``steps``) or on the swarm's wall clock (``seconds``).

In ``seconds`` mode the swarm shares a round clock: a start time ``t0`` and a round
length ``T``. Round ``r`` (1-based) spans ``[t0 + (r-1)T, t0 + rT)`` and fragment
``f`` of ``F`` syncs at ``t0 + (r-1)T + (f+1)T/F``, so fragment syncs are spread
evenly across the round and the link carries a steady stream. Every node syncs at the
same wall time with whatever it trained since its last sync, weighted by tokens; no
node waits for another.

How the clock is agreed (:func:`agree`): a run spec carries ``t0`` and its clock is the
run's. Without one, the first node of a run stores a signed manifest
``{t0, round_seconds, spec}`` in the DHT under ``{run_id}:manifest``, and every later
node with the same shared settings takes the clock from it. Anyone can write a
manifest there, so a node takes one only from a signer it trusts: the keys in
``run.clock_signers``, or else the nodes it joins through (the PeerIDs of its initial
peers), and itself (a restart); and only with the run's round length
(``sync.round_seconds``, a shared setting). Every other manifest is refused, its
reason logged once: at INFO when its only fault is an untrusted signer and its clock is
the trusted one (the other nodes of the run, which sign the clock they took), else at
WARNING. A node that takes a clock signs it again under its own key, so
the nodes that join through it trust it in turn. Of the manifests it trusts, the
earliest ``t0`` wins. Public swarms should use a run spec: its creator's signature is
the clock's.
Clocks are assumed synchronised to NTP level (tens of milliseconds): skew shifts
when a node announces a sync by that much, and the matchmaking window
(``network.matchmaking_seconds``) absorbs it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.wire.messages import Header, open_envelope, seal
from verification.identity import Identity

__all__ = ["ClockSettings", "SecondsClock", "agree"]

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

    @staticmethod
    def start_time(round_seconds: float, lead: float = 2.0) -> float:
        """A ``t0`` a little in the future, on a whole second, for a new swarm."""
        return math.ceil(time.time() + lead)


@dataclass(frozen=True)
class ClockSettings:
    """How a node agrees the round clock (built by :func:`node.settings.clock_settings`).

    Attributes:
        run_id: the run.
        spec: digest of the run spec (or shared settings) this node runs.
        round_seconds: the run's round length; a manifest with another is refused.
        fragments: fragments of the model (syncs per round).
        signers: PeerIDs whose manifests this node takes (besides its own).
        spec_t0: the run spec's ``t0``: when given, it is the clock, and the DHT is
            not consulted.
        wait: how long to look for a trusted manifest before starting a clock (0 for
            the first node of a swarm).
        lead: how far ahead of now a new clock starts.
        timeout: deadline of one DHT operation.
    """

    run_id: str
    spec: str
    round_seconds: float
    fragments: int
    signers: frozenset[str] = field(default_factory=frozenset)
    spec_t0: float | None = None
    wait: float = 0.0
    lead: float = 2.0
    timeout: float = 10.0


def _key(run_id: str) -> str:
    return f"{run_id}:manifest"


async def _read(
    transport: Transport, settings: ClockSettings, me: str, refused: dict[str, str]
) -> tuple[float, float, str] | None:
    """The earliest trusted manifest of the run: ``(t0, length, signer)``; manifests
    refused for the first time are logged (``refused``: signer -> reason, so far): at
    INFO one whose only fault is an untrusted signer and whose clock is the trusted one
    (every node of a run signs the clock it took), else at WARNING."""
    found = await transport.dht_get(_key(settings.run_id), timeout=settings.timeout, kind="clock")
    clocks, untrusted = [], []
    for signer, value in found.items() if isinstance(found, dict) else []:
        try:
            t0, length = _manifest(value, signer, settings)
        except ProtocolError as exc:
            _say(refused, signer, str(exc), logging.WARNING)
            continue
        try:
            _trust(signer, settings, me)
        except ProtocolError as exc:
            untrusted.append((signer, t0, str(exc)))
            continue
        clocks.append((t0, length, signer))
    chosen = min(clocks) if clocks else None
    for signer, t0, reason in untrusted:
        same = chosen is not None and t0 == chosen[0]
        _say(refused, signer, reason, logging.INFO if same else logging.WARNING)
    return chosen


def _say(refused: dict[str, str], signer: str, reason: str, level: int) -> None:
    """Log a refused manifest once per signer and reason."""
    if refused.get(signer) != reason:
        refused[signer] = reason
        logger.log(level, "round clock under %s refused: %s", signer, reason)


def _check(value: object, signer: str, settings: ClockSettings, me: str) -> tuple[float, float]:
    """``(t0, round_seconds)`` of a manifest this node may take.

    Raises:
        ProtocolError: a bad signature or body, another spec, another round length, or a
            signer this node does not trust.
    """
    clock = _manifest(value, signer, settings)
    _trust(signer, settings, me)
    return clock


def _manifest(value: object, signer: str, settings: ClockSettings) -> tuple[float, float]:
    """``(t0, round_seconds)`` of a well-formed manifest of this run's settings, whoever
    signed it.

    Raises:
        ProtocolError: a bad signature or body, another spec, another round length.
    """
    env = open_envelope(
        value,
        max_bytes=_MANIFEST_BYTES,
        expected_sender=signer,
        run_id=settings.run_id,
        kinds=("manifest",),
    )
    t0, length = env.body.get("t0"), env.body.get("round_seconds")
    if env.body.get("spec", "") != settings.spec:
        raise ProtocolError("spec_mismatch", "a manifest of other shared settings", signer)
    if not isinstance(t0, float) or not math.isfinite(t0):
        raise ProtocolError("malformed", f"t0 {t0!r} is not a time", signer)
    if not isinstance(length, float) or not math.isclose(length, settings.round_seconds):
        raise ProtocolError(
            "wrong_round_seconds",
            f"{length!r} s rounds, but the run's sync.round_seconds is {settings.round_seconds:g}",
            signer,
        )
    return t0, length


def _trust(signer: str, settings: ClockSettings, me: str) -> None:
    """Raises ProtocolError ``untrusted_signer`` unless this node takes clocks from ``signer``."""
    if signer != me and signer not in settings.signers:
        raise ProtocolError(
            "untrusted_signer",
            "not a clock signer this node trusts (its initial peers, or run.clock_signers)",
            signer,
        )


async def _sign(
    transport: Transport, identity: Identity, settings: ClockSettings, t0: float
) -> None:
    """Store this node's manifest of the clock ``t0`` (the nodes joining through it trust it)."""
    body = {"t0": t0, "round_seconds": float(settings.round_seconds), "spec": settings.spec}
    header = Header("manifest", settings.run_id, 0, 0, 0, identity.peer_id)
    await transport.dht_store(
        _key(settings.run_id),
        identity.peer_id,
        seal(identity, header, body),
        _MANIFEST_SECONDS,
        timeout=settings.timeout,
        kind="clock",
    )


async def agree(transport: Transport, identity: Identity, settings: ClockSettings) -> SecondsClock:
    """The run's round clock (see the module docstring)."""
    if settings.spec_t0 is not None:
        logger.info("round clock from the run spec: t0 %.1f", settings.spec_t0)
        return SecondsClock(settings.spec_t0, settings.round_seconds, settings.fragments)
    deadline = time.monotonic() + settings.wait
    refused: dict[str, str] = {}
    while True:
        found = await _read(transport, settings, identity.peer_id, refused)
        if found is not None:
            t0, length, signer = found
            logger.info("round clock from %s: t0 %.1f, %.1fs rounds", signer[:16], t0, length)
            if signer != identity.peer_id:
                await _sign(transport, identity, settings, t0)
            return SecondsClock(t0, length, settings.fragments)
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(_POLL_SECONDS)
    t0 = float(SecondsClock.start_time(settings.round_seconds, lead=settings.lead))
    await _sign(transport, identity, settings, t0)
    logger.info("started the round clock: t0 %.1f, %.1fs rounds", t0, settings.round_seconds)
    return SecondsClock(t0, settings.round_seconds, settings.fragments)
