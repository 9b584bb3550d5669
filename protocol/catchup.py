"""Catching up: serve this node's last completed global state, and take a peer's.

At the end of every round a node snapshots its global copy of every fragment and the
outer optimizer's momentum into a file it serves from (no second copy in memory), and
signs the snapshot's digest into the DHT under ``{run_id}:digest:{round}`` with its
standing (settled, unsettled or joining: :func:`node.train.agreement.swarm_state` decides
from these which state a swarm converges on after a round that went wrong). A node that
joins (or falls behind) downloads the newest snapshot over the ``atoll.state`` RPC, each
fragment in chunks of at most :data:`CHUNK_VALUES` values, spread over the peers of that
round; every chunk is a signed envelope whose round, plan, sizes and digest are checked,
the state must hash to the digest, and at least k peers (``trust.state_signers``, capped
by how many are live) must have signed it before anything is loaded. Momentum travels
as raw float32 bytes, never pickled.

This module takes a peer's state; the serving side, and the signing of digests, is
:mod:`protocol.stateserver`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from dataclasses import dataclass

import torch

from protocol.averaging.fragments import FragmentPlan
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.registry import PeerRecord
from protocol.wire.messages import Envelope, Header, open_envelope, seal
from verification.identity import Identity

__all__ = [
    "CHUNK_VALUES",
    "RPC_NAME",
    "STANDINGS",
    "CatchUpSettings",
    "StateSnapshot",
    "attested",
    "digest_key",
    "download",
    "fetch_state",
    "raw_bytes",
    "state_digest",
]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.state"
_SAID: deque[str] = deque(maxlen=64)  # catch-up failures logged at WARNING lately

STANDINGS = ("settled", "unsettled", "joining")
"""What a node's signed state digest says of the state
(:meth:`protocol.stateserver.StateServer.attest`)."""

CHUNK_VALUES = 4 * 2**20
"""Values per state reply: 16 MiB of values and as much momentum, in a 64 MiB message."""


@dataclass(frozen=True)
class CatchUpSettings:
    """How a node takes a peer's state (built by :func:`node.settings.catchup_settings`
    from ``[run]`` and ``[network]``).

    Attributes:
        run_id: the run whose state is taken.
        timeout: deadline of one state request, in seconds (``network.request_timeout``).
        max_bytes: largest state reply accepted, in bytes (``network.max_message_mb``).
    """

    run_id: str
    timeout: float = 30.0
    max_bytes: int = 256 * 2**20


@dataclass(frozen=True)
class StateSnapshot:
    """Global values and outer momentum of every fragment after ``round`` (a node
    takes one from its outer optimizer and loads one into it:
    :meth:`node.train.outer.OuterOptimizer.snapshot`, :meth:`~node.train.outer.OuterOptimizer.load_snapshot`)."""

    round: int
    plan_digest: str
    globals: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor | None, ...]
    steps: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its values and momentum (what a peer sends to hand it over)."""
        tensors = [*self.globals, *(m for m in self.momentum if m is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A float32 CPU vector's bytes, without a copy."""
    return t.detach().float().contiguous().cpu().numpy().data


def state_digest(globals_: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> str:
    """Hex sha256 over every fragment's global values, in fragment order (hashed in
    place: a float32 CPU vector is not copied)."""
    h = hashlib.sha256()
    for g in globals_:
        h.update(raw_bytes(g))
    return h.hexdigest()


def digest_key(run_id: str, round_: int) -> str:
    """The DHT key under which peers sign their state digests of ``round_``."""
    return f"{run_id}:digest:{round_}"


async def attested(
    transport: Transport, run_id: str, round_: int, *, timeout: float
) -> dict[str, dict[str, str]]:
    """``{digest: {signer: standing}}`` of the signed state digests peers stored for
    ``round_`` (see :data:`STANDINGS`)."""
    found = await transport.dht_get(digest_key(run_id, round_), timeout=timeout, kind="digest")
    out: dict[str, dict[str, str]] = {}
    for signer, value in (found or {}).items() if isinstance(found, dict) else []:
        try:
            env = open_envelope(
                value,
                max_bytes=4096,
                expected_sender=signer,
                run_id=run_id,
                kinds=("digest",),
                round_window=(round_, round_),
            )
        except ProtocolError as exc:
            logger.info("state digest under %s refused: %s", signer[:16], exc)
            continue
        digest, standing = env.body.get("digest"), env.body.get("standing")
        if isinstance(digest, str) and standing in STANDINGS:
            out.setdefault(digest, {})[signer] = standing
        else:
            logger.info("state digest under %s refused: malformed body", signer[:16])
    return out


async def fetch_state(
    transport: Transport,
    identity: Identity,
    settings: CatchUpSettings,
    peers: list[str],
    *,
    plan_digest: str,
    sizes: list[int],
    min_round: int,
    signers: int,
    digest: str | None = None,
) -> StateSnapshot:
    """Download a snapshot fragment by fragment, spread over ``peers``, and check it.

    All fragments must come from the same round and carry the same state digest (when
    ``digest`` is given, that one), the assembled globals must hash to that digest, and
    at least ``signers`` peers must have signed that digest for that round in the DHT.

    Raises:
        ProtocolError: unreachable peers, bad signatures, another run or model, wrong
            sizes, non-finite values, mixed rounds, another state than ``digest``, a
            digest that does not match, too few signers, or a round older than
            ``min_round``.
    """
    if not peers:
        raise ProtocolError("no_peer", "no peer to take the state from")
    chunks = []
    for f, size in enumerate(sizes):
        peer = peers[f % len(peers)]  # the fragments are spread over the peers
        chunks.append((peer, await _fragment(transport, identity, settings, peer, f, size)))
    round_, digest = _served(chunks, min_round, digest)
    globals_, momentum, steps = [], [], 0
    for (peer, parts), size in zip(chunks, sizes):
        values, moments, served_steps = _assemble(parts, size, plan_digest, peer)
        globals_.append(values)
        momentum.append(moments)
        steps = max(steps, served_steps)
    if state_digest(globals_) != digest:
        raise ProtocolError("bad_digest", "the assembled state does not match its digest")
    attestations = await attested(transport, settings.run_id, round_, timeout=settings.timeout)
    have = sum(1 for s in attestations.get(digest, {}).values() if s != "joining")
    if have < signers:
        raise ProtocolError(
            "unattested", f"{have} of {signers} required peers signed the state of round {round_}"
        )
    logger.info(
        "took the global state of round %d from %d peer(s), digest signed by %d",
        *(round_, len({p for p, _ in chunks}), have),
    )
    return StateSnapshot(round_, plan_digest, tuple(globals_), tuple(momentum), steps)


async def _fragment(
    transport: Transport,
    identity: Identity,
    settings: CatchUpSettings,
    peer: str,
    f: int,
    size: int,
) -> list[Envelope]:
    """Every chunk of fragment ``f`` (``size`` values), from ``peer``."""
    first = await _state_chunk(transport, identity, settings, peer, f, 0)
    count = first.body.get("chunks", 1)
    expected = max(1, -(-size // CHUNK_VALUES))
    if count != expected:
        raise ProtocolError("malformed", f"{count!r} chunks for {size} values", peer)
    parts = [first]
    for c in range(1, count):
        parts.append(await _state_chunk(transport, identity, settings, peer, f, c))
    return parts


def _served(
    chunks: list[tuple[str, list[Envelope]]], min_round: int, digest: str | None
) -> tuple[int, str]:
    """The one round and state digest every chunk was served for."""
    rounds = {env.header.round for _, parts in chunks for env in parts}
    digests = {env.body.get("digest") for _, parts in chunks for env in parts}
    if len(rounds) != 1 or len(digests) != 1:
        raise ProtocolError("mixed_state", "peers served different rounds or states")
    round_, served = rounds.pop(), digests.pop()
    if digest is not None and served != digest:
        raise ProtocolError("other_state", f"served state {str(served)[:12]}, not {digest[:12]}")
    if round_ < min_round:
        raise ProtocolError("stale_round", f"state of round {round_} < {min_round}")
    return round_, served


def _assemble(
    parts: list[Envelope], size: int, plan_digest: str, peer: str
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """One fragment's global values, momentum (None when served without) and the steps
    its chunks say, checked."""
    values, moments, steps = [], [], 0
    for c, env in enumerate(parts):
        body = env.body
        if body.get("plan") != plan_digest:
            raise ProtocolError("wrong_model", "the peer's fragment plan differs from ours", peer)
        n = min(CHUNK_VALUES, size - c * CHUNK_VALUES)
        values.append(_tensor(body.get("global"), n, peer))
        raw_m = body.get("momentum")
        moments.append(None if raw_m is None else _tensor(raw_m, n, peer))
        s = body.get("steps", 0)
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ProtocolError("malformed", "steps must be a non-negative integer", peer)
        steps = max(steps, s)
    value = torch.cat(values) if len(values) > 1 else values[0]
    if all(m is None for m in moments):
        return value, None, steps
    if any(m is None for m in moments):
        raise ProtocolError("malformed", "momentum in some chunks only", peer)
    return value, torch.cat(moments) if len(moments) > 1 else moments[0], steps


async def _state_chunk(
    transport: Transport,
    identity: Identity,
    settings: CatchUpSettings,
    peer: str,
    fragment: int,
    chunk: int,
) -> Envelope:
    """Chunk ``chunk`` of fragment ``fragment`` of ``peer``'s state, opened and checked."""
    run_id, max_bytes = settings.run_id, settings.max_bytes
    header = Header("state_req", run_id, 0, fragment, chunk, identity.peer_id)
    request = seal(identity, header, {})
    reply = await transport.call(
        peer, RPC_NAME, request, timeout=settings.timeout, max_response_bytes=max_bytes
    )
    env = open_envelope(
        reply, max_bytes=max_bytes, expected_sender=peer, run_id=run_id, kinds=("state",)
    )
    if env.header.fragment != fragment or env.header.part != chunk:
        raise ProtocolError("wrong_part", f"asked for chunk {chunk} of fragment {fragment}", peer)
    return env


def _tensor(raw: object, size: int, peer: str) -> torch.Tensor:
    if not isinstance(raw, bytes) or len(raw) != size * 4:
        raise ProtocolError("malformed", f"expected {size * 4} bytes of float32", peer)
    t = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if not torch.isfinite(t).all():
        raise ProtocolError("not_finite", "state holds NaN or inf", peer)
    return t


def download(
    transport: Transport,
    identity: Identity,
    settings: CatchUpSettings,
    sources: list[PeerRecord],
    plan: FragmentPlan,
    *,
    min_round: int,
    signers: int,
    digest: str | None = None,
) -> tuple[StateSnapshot, list[str]] | None:
    """Take the newest state ``sources`` (newest round first) offer, on this thread
    (with ``digest``: that state only): the fragments spread over every peer of the
    newest round, then each of the first three sources alone, in case one of them serves
    something else. A failure is logged at WARNING once, at DEBUG while it repeats (a
    node settling a round retries twice a second).

    Returns:
        The checked snapshot and the peers it came from, or None.
    """
    if not sources:
        return None
    sizes = [f.numel for f in plan.fragments]
    newest = sources[0].round
    spread = [r.peer for r in sources if r.round == newest][: len(sizes)]
    for peers in [spread] + [[r.peer] for r in sources[:3]]:
        fetching = fetch_state(
            transport,
            identity,
            settings,
            peers,
            plan_digest=plan.digest(),
            sizes=sizes,
            min_round=min_round,
            signers=signers,
            digest=digest,
        )
        try:
            calls = sum(max(1, -(-n // CHUNK_VALUES)) for n in sizes)
            return transport.run(fetching, settings.timeout * (calls + 1) + 5), peers
        except (ProtocolError, TimeoutError) as exc:
            text = f"catch-up from {', '.join(p[:12] for p in peers)} failed: {exc}"
            logger.log(logging.DEBUG if text in _SAID else logging.WARNING, text)
            if text not in _SAID:
                _SAID.append(text)
    return None
