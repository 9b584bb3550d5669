"""Who averages with whom: signed DHT announcements and a deterministic grouping rule.

For every ``(round, fragment)`` each node stores a signed ``announce`` envelope in the
DHT under ``{run_id}:mm:{round}:{fragment}`` with its own PeerID as the subkey
(hivemind's DHT protects subkeys only, and a reader checks that the subkey is the
envelope's signer). It then reads the key until every peer it expects has announced,
or until its matchmaking deadline. Groups follow from the announced set alone
(:mod:`protocol.averaging.grouping`), so every node that saw the same set computes the same
groups without talking to anyone. Nodes whose views
differ still finish: the all-reduce refuses parts from a peer whose group differs
(``group_mismatch``) and each side keeps its own value for those parts.

In a swarm larger than ``network.cells_above`` a read of that key would return one
announcement per node, so each node announces and reads only under its line of the
cell grid (:class:`~protocol.averaging.grouping.Cell`):
``{run_id}:mm:{round}:{fragment}:{cell}``. A reader drops an announcement whose signer
does not sit on that line, so no one can place itself in a group it does not belong to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.averaging.grouping import Cell, form_groups, group_of
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.wire.messages import Header, open_envelope, seal
from verification.identity import Identity

__all__ = [
    "Announcement",
    "MatchmakingSettings",
    "announce",
    "form_groups",
    "gather",
    "group_of",
    "voted_out",
]

logger = logging.getLogger(__name__)

_MAX_RECORD_BYTES = 16 * 1024  # one signed announcement
_MAX_EXCLUDES = 128  # votes one announcement carries (keeps it well under the record cap)
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Announcement:
    """A peer's signed wish to average ``(round, fragment)``, and whom it votes out.

    Attributes:
        peer: the announcer.
        tokens: its token count for this exchange (capped by owners).
        excludes: peers it votes to leave out of the round.
        reachable: whether others can dial it; a peer that cannot owns no part.
        spec: digest of the run spec (or shared settings) it runs; peers on another
            spec are refused.
        base: digest of its global copy of the fragment before the exchange; a group
            whose members announce different ones averages their copies too.
    """

    peer: str
    tokens: int
    excludes: frozenset[str] = frozenset()
    reachable: bool = True
    spec: str = ""
    base: str = ""


def voted_out(announcements: dict[str, Announcement]) -> set[str]:
    """Peers that more than half of the announcers vote to leave out of this round.

    Every node that read the same announcements gets the same set, so honest nodes
    that saw a peer misbehave at different moments still form the same groups: the
    peer is left out once a majority has seen it, and one node's vote (an attacker's
    included) leaves no one out.
    """
    votes: dict[str, int] = {}
    for a in announcements.values():
        for peer in a.excludes - {a.peer}:
            votes[peer] = votes.get(peer, 0) + 1
    return {p for p, v in votes.items() if 2 * v > len(announcements)}


def _mm_key(run_id: str, round_: int, fragment: int, cell: Cell | None = None) -> str:
    base = f"{run_id}:mm:{round_}:{fragment}"
    return base if cell is None else f"{base}:{cell.key}"


async def announce(
    transport: Transport,
    identity: Identity,
    run_id: str,
    round_: int,
    fragment: int,
    tokens: int,
    *,
    expiration: float,
    timeout: float,
    excludes: Iterable[str] = (),
    reachable: bool = True,
    spec: str = "",
    cell: Cell | None = None,
    base: str = "",
) -> bool:
    """Store this node's signed announcement for ``(round, fragment)`` (under its
    ``cell``'s key when given)."""
    header = Header("announce", run_id, round_, fragment, 0, identity.peer_id)
    body = {
        "tokens": int(tokens),
        "excludes": sorted(excludes)[:_MAX_EXCLUDES],
        "reachable": bool(reachable),
        "spec": spec,
        "base": base,
    }
    value = seal(identity, header, body)
    return await transport.dht.store(
        _mm_key(run_id, round_, fragment, cell),
        identity.peer_id,
        value,
        expiration,
        timeout=timeout,
        kind="matchmaking",
    )


async def read_announcements(
    transport: Transport,
    run_id: str,
    round_: int,
    fragment: int,
    *,
    timeout: float,
    cell: Cell | None = None,
) -> dict[str, Announcement]:
    """Every valid announcement for ``(round, fragment)`` (of ``cell``'s line when given);
    forged or stale ones, and those of peers off the line, are dropped."""
    found = await transport.dht.get(
        _mm_key(run_id, round_, fragment, cell), timeout=timeout, kind="matchmaking"
    )
    out: dict[str, Announcement] = {}
    if not isinstance(found, dict):
        return out
    for subkey, value in found.items():
        try:
            env = open_envelope(
                value,
                max_bytes=_MAX_RECORD_BYTES,
                expected_sender=subkey,
                run_id=run_id,
                kinds=("announce",),
                round_window=(round_, round_),
            )
            tokens, excludes = env.body.get("tokens"), env.body.get("excludes", [])
            reachable, spec = env.body.get("reachable", True), env.body.get("spec", "")
            base = env.body.get("base", "")
            if env.header.fragment != fragment or not isinstance(tokens, int) or tokens < 0:
                raise ProtocolError("malformed", "announcement for another fragment or bad tokens")
            if not isinstance(excludes, list) or not all(isinstance(p, str) for p in excludes):
                raise ProtocolError("malformed", "excludes must be a list of PeerIDs")
            if not isinstance(reachable, bool) or not isinstance(spec, str):
                raise ProtocolError("malformed", "reachable must be a bool and spec a str")
            if not isinstance(base, str) or len(base) > 128:
                raise ProtocolError("malformed", "base must be a short str")
            if cell is not None and not cell.holds(subkey):
                raise ProtocolError("wrong_cell", f"its signer is not on line {cell.key}")
        except ProtocolError as exc:
            logger.info("announcement under %s rejected: %s", subkey[:16], exc)
            continue
        out[subkey] = Announcement(subkey, tokens, frozenset(excludes), reachable, spec, base)
    return out


@dataclass(frozen=True)
class MatchmakingSettings:
    """How this node announces and how long it waits for its peers' announcements
    (:meth:`protocol.averaging.exchange.ExchangeSettings.matchmaking` builds it).

    Attributes:
        run_id: the run.
        spec: digest of the run spec this node runs.
        wait_seconds: how long to wait for expected peers' announcements.
        expiration: seconds an announcement stays in the DHT.
        request_timeout: deadline of one DHT operation.
        base_rate_peers: peers above which announcement reads are spaced out
            (``network.base_rate_peers``).
    """

    run_id: str
    spec: str = ""
    wait_seconds: float = 3.0
    expiration: float = 60.0
    request_timeout: float = 10.0
    base_rate_peers: int = 8


async def gather(
    transport: Transport,
    identity: Identity,
    settings: MatchmakingSettings,
    round_: int,
    fragment: int,
    tokens: int,
    *,
    expected: Iterable[str],
    excludes: Iterable[str] = (),
    reachable: bool = True,
    cell: Cell | None = None,
    base: str = "",
) -> dict[str, Announcement]:
    """Announce, then read announcements until every expected peer is there or
    ``settings.wait_seconds`` have passed.

    A read returns every announcement under the key, so with more than
    ``settings.base_rate_peers`` peers expected the reads are spaced by
    ``0.2 s * peers / base_rate_peers`` rather than 0.2 s: the bytes a waiting node reads
    per second stay flat as the swarm grows. With a ``cell`` only that line's
    announcements are written and read (``expected`` should then hold only peers on it).

    Args:
        expected: peers believed alive (from the registry); the wait ends as soon as all
            of them have announced.
        excludes: peers this node votes to leave out of the round (see :func:`voted_out`).
        reachable: whether others can dial this node (it owns no part otherwise).
        cell: this node's line of the cell grid, in a swarm too large to read whole.
        base: digest of this node's global copy of the fragment.

    Returns:
        The announced peers, this node included (filtering them is the caller's).
    """
    s = settings
    deadline = time.monotonic() + s.wait_seconds
    await announce(
        transport,
        identity,
        s.run_id,
        round_,
        fragment,
        tokens,
        expiration=s.expiration,
        timeout=s.request_timeout,
        excludes=excludes,
        reachable=reachable,
        spec=s.spec,
        cell=cell,
        base=base,
    )
    want = set(expected) | {identity.peer_id}
    me = Announcement(identity.peer_id, tokens, frozenset(excludes), reachable, s.spec, base)
    seen = {identity.peer_id: me}
    return await _read_until(transport, s, round_, fragment, want, seen, deadline, cell)


async def _read_until(
    transport: Transport,
    s: MatchmakingSettings,
    round_: int,
    fragment: int,
    want: set[str],
    seen: dict[str, Announcement],
    deadline: float,
    cell: Cell | None,
) -> dict[str, Announcement]:
    """Read announcements into ``seen`` until it holds ``want`` or ``deadline`` passes
    (reads spaced out as :func:`gather` says)."""
    poll = _POLL_SECONDS * max(1.0, len(want) / s.base_rate_peers)
    while True:
        remaining = deadline - time.monotonic()
        try:
            found = await read_announcements(
                transport,
                s.run_id,
                round_,
                fragment,
                timeout=max(0.5, min(s.request_timeout, remaining)),
                cell=cell,
            )
            seen.update(found)
        except ProtocolError as exc:
            logger.debug("matchmaking read failed: %s", exc)
        if want <= set(seen) or time.monotonic() >= deadline:
            return seen
        await asyncio.sleep(min(poll, max(0.0, deadline - time.monotonic())))
