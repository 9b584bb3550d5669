"""Round commitments: what each member of an exchange signed it would send, before it sent.

Before an exchange a member signs the digests of its parts for ``(round, fragment,
content)`` and sends that commitment straight to each member of its group (RPC
:data:`COMMIT_RPC` over the node's transport); in a swarm of up to
``control.base_rate_peers`` nodes it is also gossiped on the ``commit`` topic, so every
node holds every commitment. Above that it is not (every node receiving every
commitment would grow with the swarm), and an owner puts the commitments it relied on
into its signed result instead: that is what lets anyone tell a framed owner from a bad
one (:mod:`verification.evidence`).

An owner takes a part only if its sender committed to exactly that digest before the
owner's own commit phase closed. Two different signed commitments from one peer for the
same exchange are proof of equivocation, and this node convicts on it. A result that
misstates this node's committed input is reported by :meth:`CommitmentStore.check_result`
and convicted by its caller through :meth:`CommitmentStore.convict_owner`.

Waiting for a commitment (the commit phase, a part that overtook its commitment) waits
on an :class:`asyncio.Event` that each arriving commitment sets, whichever thread it
arrives on: gossip on the channel's thread, direct sends on the transport's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.averaging.hooks import Commitments
from protocol.control.channel import ControlChannel
from protocol.control.commitwire import commit_fields, commit_wire
from protocol.control.frames import ControlMessage, open_control, topic_name
from protocol.control.heartbeats import Pace
from protocol.control.settings import ControlSettings
from protocol.errors import ProtocolError
from verification.evidence import misstated
from verification.rounds import RoundClock

__all__ = [
    "COMMIT_RPC",
    "CommitmentStore",
    "CommitLinks",
    "Convict",
    "SendDirect",
]

logger = logging.getLogger(__name__)

COMMIT_RPC = "atoll.commit"
"""The RPC a member's signed commitment is sent to its group members through."""

SendDirect = Callable[[str, bytes, float], Awaitable[Any]]
"""Sends a signed commitment to a peer's :data:`COMMIT_RPC`: ``(peer, bytes, timeout)``."""

Convict = Callable[[str, int, int, str, Any, bool], None]
"""``(peer, round, fragment, kind, evidence, publish)``: act on proof that ``peer``
cheated, and publish the verdict when ``publish``."""

_ROUNDS_KEPT = 4  # commitments older than this many rounds are forgotten
_ROUNDS_AHEAD = 4
"""A peer's commitment for a round further than this past this node's own newest is
ignored: it concerns no exchange of this node's, and counted it would move the store's
newest round there and forget the commitments of the rounds being exchanged."""
_MAX_COMMITS = 65536
_RESEND_PAUSE_S = 0.02  # between the two tries of a direct send without gossip
_OVERTAKE_SECONDS = 1.0


@dataclass(frozen=True)
class CommitLinks:
    """What a :class:`CommitmentStore` asks of the rest of the node.

    Args:
        channel: returns the control channel, None while there is none.
        blocks: why this node does not deal with a peer at a round (None: it does);
            the commit phase does not wait for a blocked peer.
        convict: acts on proof that a peer cheated.
        send_direct: sends a commitment to a peer's :data:`COMMIT_RPC`; None sends
            none directly.
    """

    channel: Callable[[], ControlChannel | None]
    blocks: Callable[[str, int], str | None]
    convict: Convict
    send_direct: SendDirect | None = None


@dataclass(frozen=True)
class _Commit:
    digests: dict[int, bytes]
    received: float  # this node's time.monotonic() when it arrived
    wire: bytes  # the signed message itself: evidence if the sender equivocates


class CommitmentStore(Commitments):
    """This node's commitments and those it received, for the commit phase of its
    exchanges (the :class:`~protocol.averaging.hooks.Commitments` an all-reduce takes).

    Args:
        settings: the control plane's settings (run, message cap).
        me: this node's PeerID.
        pace: the commit window, and whether commitments are gossiped.
        links: the channel, the block list, convictions and direct sends.
        clock: the node's round clock: commitments of rounds long before its current
            one are forgotten (default: one of its own, at round 0).
    """

    def __init__(
        self,
        settings: ControlSettings,
        me: str,
        pace: Pace,
        links: CommitLinks,
        clock: RoundClock | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock if clock is not None else RoundClock()
        self.me = me
        self.pace = pace
        self.send_direct = links.send_direct
        self._channel = links.channel
        self._blocks = links.blocks
        self._convict = links.convict
        self._lock = threading.Lock()
        self._commits: dict[tuple[str, int, int, str], _Commit] = {}
        # the coroutines waiting for a commitment, each woken on its own loop
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._forgot_below = 0  # the horizon of the last sweep of old commitments
        self._sending: set[asyncio.Task] = set()

    # ---- this node's commitments ------------------------------------------------------

    async def commit(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
        content: str = "update",
    ) -> None:
        wire = await self.publish_commit(round_, fragment, digests, content)
        self._send_to_group(group, wire)
        others = [p for p in group if p != self.me and not self._blocks(p, round_)]
        keys = [(p, round_, fragment, content) for p in others]
        if await self._wait_for(
            lambda: all(k in self._commits for k in keys), self.pace.commit_window
        ):
            return
        logger.info(
            "round %d fragment %d (%s): commit phase closed without %s",
            round_,
            fragment,
            content,
            [p[:12] for p in others if (p, round_, fragment, content) not in self._commits],
        )

    def _send_to_group(self, group: Sequence[str], wire: bytes) -> None:
        """Send the signed commitment to every other member, in the background."""
        if self.send_direct is None or not wire:
            return
        for peer in group:
            if peer != self.me:
                task = asyncio.ensure_future(self._send_one(peer, wire))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def _send_one(self, peer: str, wire: bytes) -> None:
        assert self.send_direct is not None
        # without a gossip copy the direct one is the only one: try it twice
        attempts = 1 if self.pace.gossips_commitments else 2
        deadline = time.monotonic() + self.pace.commit_window
        for attempt in range(attempts):
            try:
                await self.send_direct(peer, wire, max(0.1, deadline - time.monotonic()))
                return
            except Exception as exc:
                logger.debug("control: commitment to %s not sent directly: %s", peer[:16], exc)
            if attempt + 1 < attempts:
                await asyncio.sleep(min(_RESEND_PAUSE_S, max(0.0, deadline - time.monotonic())))

    async def publish_commit(
        self, round_: int, fragment: int, digests: dict[int, bytes], content: str = "update"
    ) -> bytes:
        """Publish (and record) this node's commitment for ``(round, fragment, content)``;
        returns the signed message (empty without a channel)."""
        body = {
            "round": round_,
            "fragment": fragment,
            "content": content,
            "digests": [[j, d] for j, d in sorted(digests.items())],
        }
        wire = b""
        channel = self._channel()
        if channel is not None:
            topic = topic_name(self.settings.run_id, "commit")
            wire = channel.sign(topic, body)
            if self.pace.gossips_commitments and not channel.publish_signed(topic, wire):
                logger.debug("control: sidecar down, commitment not gossiped")
        with self._lock:
            self._commits[(self.me, round_, fragment, content)] = _Commit(
                dict(digests), time.monotonic(), wire
            )
            self.clock.start(round_)
            self._forget_old()
        self._wake()
        return wire

    # ---- commitments received ---------------------------------------------------------

    async def receive_commit(self, peer: str, data: bytes) -> bytes:
        """Serve :data:`COMMIT_RPC`: a group member's signed commitment, sent directly.

        Raises:
            ProtocolError: the message is not a valid commitment signed by ``peer``
                (the authenticated caller).
        """
        run = self.settings.run_id
        msg = open_control(data, run, topic_name(run, "commit"), self.settings.max_bytes)
        if msg.sender != peer:
            raise ProtocolError("sender_mismatch", f"a commitment signed by {msg.sender}", peer)
        if msg.sender != self.me:
            self.receive(msg)
        return b""

    def receive(self, msg: ControlMessage) -> None:
        """Record a commitment from the channel or sent directly; a second one from the
        same sender for the same exchange that differs convicts it of equivocation.

        Raises:
            ProtocolError: ``malformed``: the body is not a commitment.
        """
        r, f, content, digests = commit_fields(msg.body)
        key = (msg.sender, r, f, content)
        new = _Commit(digests, time.monotonic(), commit_wire(msg))
        with self._lock:
            current = self.clock.current
            if current and r > current + _ROUNDS_AHEAD:
                logger.debug(
                    "control: commitment of %s for round %d ignored (this node is at %d)",
                    msg.sender[:16],
                    r,
                    current,
                )
                return
            old = self._commits.get(key)
            if old is None:
                self._commits[key] = new
                self._forget_old()
        if old is None:
            self._wake()
            return
        if old.digests != digests and old.wire:
            evidence = [old.wire, new.wire]
            self._convict(msg.sender, r, f, "equivocation", evidence, True)

    # ---- waiting for commitments ---------------------------------------------------------

    async def _wait_for(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``ready()`` (called with the lock held)
        is true; returns whether it is. Woken by each commitment recorded."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._waiters.add(waiter)
        try:
            while True:
                event.clear()  # on this loop, before the check: no wake-up is lost
                with self._lock:
                    if ready():
                        return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _wake(self) -> None:
        """Wake every waiter on its own loop (a commitment was recorded)."""
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                loop.call_soon_threadsafe(event.set)

    def _forget_old(self) -> None:
        """Drop commitments from rounds long before the clock's (called with the lock
        held); swept once per round, or at every new one above the cap."""
        horizon = self.clock.current - _ROUNDS_KEPT
        if horizon <= self._forgot_below and len(self._commits) < _MAX_COMMITS:
            return
        self._forgot_below = horizon
        for key in [k for k in self._commits if k[1] < horizon]:
            del self._commits[key]

    # ---- the owner's and the member's checks ---------------------------------------------

    async def check(
        self,
        peer: str,
        round_: int,
        fragment: int,
        part: int,
        digest: bytes,
        closed_at: float,
        content: str = "update",
    ) -> str | None:
        key = (peer, round_, fragment, content)
        # A commitment travels by gossip and its part by a direct stream, so a part sent
        # right after a (late) commitment can overtake it: wait a moment to tell a late
        # commitment from none at all. Either way the part is refused.
        await self._wait_for(lambda: key in self._commits, _OVERTAKE_SECONDS)
        with self._lock:
            rec = self._commits.get(key)
        if rec is None:
            return "uncommitted"
        if rec.received > closed_at:
            return "late_commit"
        if rec.digests.get(part) != digest:
            return "commit_mismatch"
        return None

    def committed(self, peer: str, round_: int, fragment: int, content: str = "update") -> bool:
        with self._lock:
            return (peer, round_, fragment, content) in self._commits

    def digests(
        self, peer: str, round_: int, fragment: int, content: str = "update"
    ) -> dict[int, bytes] | None:
        """The part digests ``peer`` committed to for the exchange, or None (a copy)."""
        with self._lock:
            rec = self._commits.get((peer, round_, fragment, content))
        return dict(rec.digests) if rec is not None else None

    def evidence(self, peer: str, round_: int, fragment: int, content: str = "update") -> bytes:
        with self._lock:
            rec = self._commits.get((peer, round_, fragment, content))
        return rec.wire if rec is not None else b""

    def check_result(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reply: bytes,
        contributors: Sequence[str],
        digests: Sequence[bytes],
        content: str = "update",
    ) -> str | None:
        """``bad_owner`` when the result names, for this node, a digest other than the one
        it committed to (None otherwise); convicts nobody (see :meth:`convict_owner`)."""
        with self._lock:
            rec = self._commits.get((self.me, round_, fragment, content))
        committed = rec.digests if rec is not None else None
        if not misstated(self.me, committed, part, contributors, digests):
            return None
        return "bad_owner"

    def convict_owner(
        self, owner: str, round_: int, fragment: int, reply: bytes, content: str = "update"
    ) -> None:
        """Convict ``owner``, whose signed result ``reply`` misstated this node's committed
        input (:meth:`check_result` said ``bad_owner``), and publish the verdict with the
        result and this node's signed commitment as evidence."""
        with self._lock:
            rec = self._commits.get((self.me, round_, fragment, content))
        if rec is not None and rec.wire:
            evidence = {"reduced": reply, "commit": rec.wire}
            self._convict(owner, round_, fragment, "bad_owner", evidence, True)
