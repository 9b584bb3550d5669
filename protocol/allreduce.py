"""Butterfly all-reduce of one fragment inside one group, over signed messages.

The fragment's vector is cut into one contiguous part per group member, in group
order. Member ``i`` sends its encoded, signed part ``j`` to member ``j`` (the part's
*owner*) in one RPC; the owner waits until every member's part is in or its
deadline passes, reduces what it has (token-weighted mean unless a robust reducer is
plugged in), encodes and signs the result once, and answers every caller with the
same bytes. Each member assembles the full vector from the reduced parts; the owner
uses the decoded bytes it sent, so every member ends with bitwise identical values.

Nothing waits forever: a member that vanishes costs only its contribution; a part
whose owner vanished (or answered with something invalid) falls back to this node's
own value, and :class:`AllReduceResult` says exactly which peers are in which part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from protocol import codec as codecs
from protocol.errors import ProtocolError
from protocol.messages import Envelope, Header, envelope_digest, open_envelope, seal
from protocol.repair import PartRepair
from protocol.transport import Transport
from verification.identity import Identity

__all__ = [
    "AllReduceResult",
    "AllReduceService",
    "AllReduceSettings",
    "Behaviour",
    "Commitments",
    "Contribution",
    "Observer",
    "Reduction",
    "part_bounds",
    "weighted_mean_reducer",
]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.part"
_SESSION_ROUNDS_KEPT = 3


@dataclass(frozen=True)
class AllReduceSettings:
    """How parts are encoded, bounded and waited for."""

    run_id: str
    codec: str = "none"
    block_size: int = 256
    timeout: float = 30.0
    max_tokens: int = 10**9
    max_message_bytes: int = 256 * 2**20
    round_window: int = 2
    fragments: int = 1024
    repair: bool = True
    fragment_codecs: tuple[str, ...] = ()
    """Per-fragment codecs (e.g. pseudo-gradients in int8, mixed weights in fp16);
    fragments past the end of this tuple use ``codec``."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.timeout <= 0 or self.fragments < 1:
            raise ValueError("block_size, timeout and fragments must be positive")

    def codec_for(self, fragment: int) -> str:
        """The codec this node encodes ``fragment``'s parts and results with."""
        if 0 <= fragment < len(self.fragment_codecs):
            return self.fragment_codecs[fragment]
        return self.codec


@dataclass(frozen=True)
class Contribution:
    """One member's decoded part, as the owner received it.

    ``tokens`` is what the peer claimed; ``weight`` is that claim capped by
    ``AllReduceSettings.max_tokens``.
    """

    peer: str
    vector: torch.Tensor
    weight: float
    digest: bytes
    tokens: int = 0


@dataclass(frozen=True)
class Reduction:
    """An owner's reduced part: the vector, who is in it, and who was refused and why."""

    vector: torch.Tensor
    used: list[str]
    rejected: dict[str, str] = field(default_factory=dict)


Reducer = Callable[[int, int, int, Sequence[Contribution]], Reduction]
"""``(round, fragment, part, contributions) -> Reduction`` on the part's owner."""


def weighted_mean_reducer(
    round_: int, fragment: int, part: int, contributions: Sequence[Contribution]
) -> Reduction:
    """Token-weighted mean (plain mean when every weight is zero)."""
    weights = [max(0.0, c.weight) for c in contributions]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(contributions), float(len(contributions))
    out = torch.zeros_like(contributions[0].vector)
    for c, w in zip(contributions, weights):
        out.add_(c.vector, alpha=w / total)
    return Reduction(out, [c.peer for c in contributions])


class Observer:
    """What the node hears from the all-reduce; the default ignores everything."""

    def admit(self, peer: str, round_: int) -> str | None:
        """Whether this node takes parts from ``peer`` at all; a reason refuses them."""
        return None

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        """A message from the authenticated ``peer`` was refused before aggregation."""

    def on_owner_refused(
        self, owner: str, round_: int, fragment: int, part: int, reason: str
    ) -> None:
        """This node refused ``owner``'s reduced part (it keeps its own values there)."""

    def check_reduced(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float = 1.0,
    ) -> str | None:
        """Judge a reduced part against this node's own contribution; a reason refuses it.

        ``spread`` is the largest contributor weight over this node's own (at least 1):
        a node that trained less than its peers sees a larger average than its own.
        """
        return None


class Commitments:
    """The commit phase of an exchange; a service without one skips it.

    Before sending any part, a member publishes the digests of its signed parts for
    ``(round, fragment)`` and waits (bounded) for its group's commitments. An owner
    takes a part only if its sender committed to exactly that digest before the
    owner's own commit phase closed, so no member can shape its part after seeing
    the others'.
    """

    async def commit(
        self, round_: int, fragment: int, group: Sequence[str], digests: dict[int, bytes]
    ) -> None:
        """Publish this node's commitment and wait for the group's (bounded)."""

    async def check(
        self, peer: str, round_: int, fragment: int, part: int, digest: bytes, closed_at: float
    ) -> str | None:
        """Why ``peer``'s part is refused: ``uncommitted``, ``late_commit`` or
        ``commit_mismatch`` (None: committed in time). ``closed_at`` is this owner's
        ``time.monotonic()`` when its commit phase closed."""
        return None

    def check_result(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reply: bytes,
        contributors: Sequence[str],
        digests: Sequence[bytes],
    ) -> str | None:
        """Why an owner's signed result is refused: ``bad_owner`` when it names, for a
        contributor, a digest other than the one that contributor committed to."""
        return None


class Behaviour:
    """How this node acts in an all-reduce; honest by default.

    Fault injection (``atoll run --byzantine MODE``) overrides these hooks; nothing in
    the honest path depends on them.
    """

    def contribution(self, round_: int, fragment: int, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def request(
        self,
        service: AllReduceService,
        header: Header,
        body: dict,
        encoded: codecs.Encoded,
    ) -> bytes:
        return seal(service.identity, header, dict(body, data=encoded.to_wire()))

    async def commit(
        self,
        commitments: Commitments,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
    ) -> None:
        await commitments.commit(round_, fragment, group, digests)

    def reduced_body(self, body: dict) -> dict:
        return body

    def reduced(self, vector: torch.Tensor) -> torch.Tensor:
        return vector


def part_bounds(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges, near-equal and aligned to ``align`` elements.

    Aligning part edges to the codec's block size means a part is encoded with the
    same blocks as the whole vector would be.
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    blocks = -(-numel // align)
    base, extra = divmod(blocks, parts)
    out, start = [], 0
    for p in range(parts):
        size = (base + (1 if p < extra else 0)) * align
        end = min(numel, start + size)
        out.append((start, end))
        start = end
    return out


@dataclass
class AllReduceResult:
    """What one all-reduce produced, and exactly whose values are in it."""

    vector: torch.Tensor
    group: list[str]
    contributors: list[list[str]]
    fallback_parts: list[int]
    repaired_parts: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """True when every part holds every group member's contribution."""
        return (
            not self.fallback_parts
            and not self.repaired_parts
            and all(sorted(c) == sorted(self.group) for c in self.contributors)
        )

    @property
    def peers_in(self) -> set[str]:
        return {p for part in self.contributors for p in part}


@dataclass
class _Session:
    """The owner's side of one ``(round, fragment)``: its part's contributions."""

    created: float
    group: list[str] | None = None
    index: int = -1
    numel: int = 0
    deadline: float = 0.0
    contributions: dict[str, Contribution] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    full: asyncio.Event = field(default_factory=asyncio.Event)
    reduced: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    closed_at: float = 0.0
    mismatches: int = 0
    reply: bytes = b""


class AllReduceService:
    """This node's all-reduce endpoint and client.

    Args:
        transport: the node's transport.
        identity: the node's key (signs every part and every reduced result).
        settings: encoding, limits and deadlines.
        reducer: how an owner combines contributions (weighted mean by default).
        observer: told about refusals and judges reduced parts (ignores all by default).
        behaviour: how this node acts (honest by default; fault injection overrides it).
        commitments: the commit phase (none by default: parts are sent at once).
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        settings: AllReduceSettings,
        reducer: Reducer = weighted_mean_reducer,
        observer: Observer | None = None,
        behaviour: Behaviour | None = None,
        commitments: Commitments | None = None,
    ) -> None:
        self.transport = transport
        self.identity = identity
        self.settings = settings
        self.reducer = reducer
        self.observer = observer or Observer()
        self.behaviour = behaviour or Behaviour()
        self.commitments = commitments
        self.repair = PartRepair(self)
        self.current_round = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rejected: dict[str, int] = {}
        self._sessions: dict[tuple[int, int], _Session] = {}
        # Bytes per (round, fragment): two exchanges in flight at once (a fragment and
        # its weight mix) must not count each other's traffic.
        self._ledger: dict[tuple[int, int], list[int]] = {}
        # Rounds in the replay window times fragments, plus the kept history.
        self._max_sessions = settings.fragments * (settings.round_window + _SESSION_ROUNDS_KEPT + 2)

    def register(self) -> None:
        """Start serving part requests."""
        self.transport.add_handler(
            RPC_NAME,
            self._handle,
            max_request_bytes=self.settings.max_message_bytes,
            timeout=self.settings.timeout * 2 + 5.0,
        )
        self.repair.register()

    # ---- owner side -------------------------------------------------------------------

    def _session(self, round_: int, fragment: int) -> _Session:
        key = (round_, fragment)
        if key not in self._sessions:
            self._sessions[key] = _Session(created=time.monotonic())
        for old in [k for k in self._sessions if k[0] < self.current_round - _SESSION_ROUNDS_KEPT]:
            del self._sessions[old]
        for old in [k for k in self._ledger if k[0] < self.current_round - _SESSION_ROUNDS_KEPT]:
            del self._ledger[old]
        return self._sessions[key]

    def tally(self, at: tuple[int, int], sent: int = 0, received: int = 0) -> None:
        """Charge bytes to the exchange of ``(round, fragment)``."""
        entry = self._ledger.setdefault(at, [0, 0])
        entry[0] += sent
        entry[1] += received

    def _reject(
        self,
        reason: str,
        detail: str,
        peer: str,
        round_: int | None = None,
        fragment: int | None = None,
    ) -> ProtocolError:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        try:
            self.observer.on_refusal(peer, round_, fragment, reason)
        except Exception:  # bookkeeping must never change what the protocol answers
            logger.exception("observer failed on a refusal from %s", peer)
        return ProtocolError(reason, detail, peer)

    async def _handle(self, peer: str, data: bytes) -> bytes:
        self.bytes_received += len(data)
        lo = max(0, self.current_round - 1)
        try:
            env = open_envelope(
                data,
                max_bytes=self.settings.max_message_bytes,
                expected_sender=peer,
                run_id=self.settings.run_id,
                kinds=("part",),
                round_window=(lo, self.current_round + self.settings.round_window),
            )
        except ProtocolError as exc:
            raise self._reject(exc.reason, exc.detail, peer) from None
        h = env.header
        at = (h.round, h.fragment)
        refusal = self.observer.admit(peer, h.round)
        if refusal:
            raise self._reject(refusal, "refused by this node's trust policy", peer, *at)
        if h.fragment >= self.settings.fragments:
            raise self._reject("wrong_part", f"no fragment {h.fragment}", peer, *at)
        if at not in self._sessions and len(self._sessions) >= self._max_sessions:
            raise self._reject("busy", "too many rounds in flight", peer, *at)
        session = self._session(h.round, h.fragment)
        self.tally(at, received=len(data))
        try:
            await asyncio.wait_for(session.ready.wait(), self.settings.timeout)
        except asyncio.TimeoutError:
            raise self._reject(
                "not_in_round", "this node did not join that round", peer, *at
            ) from None
        group = env.body.get("group")
        if group != session.group:
            raise self._reject(
                "group_mismatch", "sender's group differs from the owner's", peer, *at
            )
        if peer not in session.group or h.part != session.index:
            raise self._reject("wrong_part", f"part {h.part} is not owned here", peer, *at)
        known = session.contributions.get(peer)
        if known is not None and known.digest == env.digest:
            # The same signed part again: the sender lost the answer and retried.
            await asyncio.wait_for(session.reduced.wait(), self.settings.timeout + 5.0)
            self.bytes_sent += len(session.reply)
            return session.reply
        if known is not None:
            raise self._reject(
                "duplicate", "a second part for the same round and fragment", peer, *at
            )
        contribution = self._decode_contribution(env, session.numel, peer)
        if self.commitments is not None:
            try:
                await asyncio.wait_for(session.committed.wait(), self.settings.timeout)
            except asyncio.TimeoutError:
                raise self._reject("not_in_round", "commit phase never closed", peer, *at) from None
            refusal = await self.commitments.check(
                peer, h.round, h.fragment, h.part, env.digest, session.closed_at
            )
            if refusal:
                raise self._reject(refusal, "part does not match a timely commitment", peer, *at)
        if time.monotonic() > session.deadline or session.reduced.is_set():
            raise self._reject("late", "part arrived after the owner's deadline", peer, *at)
        session.contributions[peer] = contribution
        if session.expected <= set(session.contributions):
            session.full.set()
        await asyncio.wait_for(session.reduced.wait(), self.settings.timeout + 5.0)
        self.bytes_sent += len(session.reply)
        return session.reply

    def _decode_contribution(self, env: Envelope, numel: int, peer: str) -> Contribution:
        at = (env.header.round, env.header.fragment)
        try:
            enc = codecs.Encoded.from_wire(env.body.get("data"), max_numel=numel)
            vector = codecs.decode(enc, expected_numel=numel)
        except ProtocolError as exc:
            raise self._reject(exc.reason, exc.detail, peer, *at) from None
        weight = env.body.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
            raise self._reject("malformed", "weight must be a non-negative integer", peer, *at)
        return Contribution(
            peer=peer,
            vector=vector,
            weight=float(min(weight, self.settings.max_tokens)),
            digest=env.digest,
            tokens=weight,
        )

    async def _reduce_own_part(self, session: _Session, h: Header) -> torch.Tensor:
        """Wait for the group's parts (or the deadline), reduce, sign, publish."""
        try:
            await asyncio.wait_for(
                session.full.wait(), max(0.0, session.deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            missing = sorted(set(session.group or ()) - set(session.contributions))
            logger.warning(
                "round %d fragment %d part %d: deadline passed without %s",
                h.round,
                h.fragment,
                h.part,
                ", ".join(p[:16] for p in missing),
            )
        contributions = list(session.contributions.values())
        reduction = self.reducer(h.round, h.fragment, h.part, contributions)
        reduced = self.behaviour.reduced(reduction.vector)
        enc = codecs.encode(
            reduced, self.settings.codec_for(h.fragment), block_size=self.settings.block_size
        )
        used_set = set(reduction.used)
        body = {
            "contributors": [c.peer for c in contributions if c.peer in used_set],
            "weights": [c.weight for c in contributions if c.peer in used_set],
            "digests": [c.digest for c in contributions if c.peer in used_set],
            "rejected": {p: r for p, r in reduction.rejected.items() if isinstance(r, str)},
            "data": enc.to_wire(),
        }
        body = self.behaviour.reduced_body(body)
        session.reply = seal(self.identity, Header("reduced", *_fields(h)), body)
        # every other contributor is waiting for this one reply
        self.tally((h.round, h.fragment), sent=len(session.reply) * (len(contributions) - 1))
        session.reduced.set()
        return codecs.decode(enc, expected_numel=session.numel)

    # ---- member side ------------------------------------------------------------------

    async def run(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        vector: torch.Tensor,
        weight: int,
    ) -> AllReduceResult:
        """All-reduce ``vector`` with ``group`` for ``(round, fragment)``.

        Args:
            group: the members in group order; must contain this node.
            vector: this node's (already quantized) flat float32 contribution.
            weight: tokens this node processed for it (capped by the owner).
        """
        started = time.monotonic()
        me = self.identity.peer_id
        group = list(group)
        index = group.index(me)
        numel = vector.numel()
        bounds = part_bounds(numel, len(group), self.settings.block_size)
        vector = self.behaviour.contribution(round_, fragment, vector)

        session = self._session(round_, fragment)
        start, end = bounds[index]
        session.group, session.index, session.numel = group, index, end - start
        session.deadline = started + self.settings.timeout
        own_header = Header("part", self.settings.run_id, round_, fragment, index, me)
        own_env = seal(self.identity, own_header, {})
        session.contributions[me] = Contribution(
            peer=me,
            vector=vector[start:end].clone(),
            weight=float(min(weight, self.settings.max_tokens)),
            digest=open_envelope(own_env).digest,
            tokens=int(weight),
        )
        # Members this node's policy refuses will not be waited for.
        session.expected = {p for p in group if p == me or not self.observer.admit(p, round_)}
        if session.expected <= set(session.contributions):
            session.full.set()
        session.ready.set()
        requests = {
            j: self._request(round_, fragment, group, j, vector[lo:hi], weight)
            for j, (lo, hi) in enumerate(bounds)
            if j != index
        }
        await self._commit_phase(session, round_, fragment, group, requests)

        async def exchange(j: int) -> tuple[int, torch.Tensor | None, list[str]]:
            lo, hi = bounds[j]
            if j == index:
                own = await self._reduce_own_part(session, own_header)
                return j, own, list(_contributors(session.reply))
            result = await self._send_part(
                round_, fragment, group, j, lo, hi, vector, weight, requests[j]
            )
            if result[1] is None and self.settings.repair and len(group) > 2:
                fixed = await self.repair.run(
                    round_, fragment, j, group, group[j], vector[lo:hi], weight
                )
                if fixed is not None:
                    repaired.append(j)
                    return j, fixed[0], fixed[1]
            return result

        repaired: list[int] = []
        results = await asyncio.gather(*(exchange(j) for j in range(len(group))))
        out = vector.clone()
        contributors: list[list[str]] = []
        fallback: list[int] = []
        for j, part, peers in sorted(results, key=lambda r: r[0]):
            lo, hi = bounds[j]
            if part is None:
                fallback.append(j)
                contributors.append([me])
            else:
                out[lo:hi] = part
                contributors.append(peers)
        return AllReduceResult(
            vector=out,
            group=group,
            contributors=contributors,
            fallback_parts=fallback,
            repaired_parts=sorted(repaired),
            bytes_sent=self._ledger.get((round_, fragment), [0, 0])[0],
            bytes_received=self._ledger.get((round_, fragment), [0, 0])[1],
            seconds=time.monotonic() - started,
        )

    def _request(
        self,
        round_: int,
        fragment: int,
        group: list[str],
        j: int,
        values: torch.Tensor,
        weight: int,
    ) -> bytes:
        """The signed part message for owner ``j`` (built before anything is sent)."""
        enc = codecs.encode(
            values, self.settings.codec_for(fragment), block_size=self.settings.block_size
        )
        header = Header("part", self.settings.run_id, round_, fragment, j, self.identity.peer_id)
        return self.behaviour.request(self, header, {"group": group, "weight": int(weight)}, enc)

    async def _commit_phase(
        self,
        session: _Session,
        round_: int,
        fragment: int,
        group: list[str],
        requests: dict[int, bytes],
    ) -> None:
        """Commit to every part's digest and wait for the group's, when commitments are on."""
        try:
            if self.commitments is not None:
                digests = {}
                for j, request in requests.items():
                    with contextlib.suppress(ProtocolError):  # a mangled part commits to nothing
                        digests[j] = envelope_digest(request)
                await self.behaviour.commit(self.commitments, round_, fragment, group, digests)
        finally:
            session.closed_at = time.monotonic()
            session.committed.set()

    def _note_mismatch(self, round_: int, fragment: int, group_size: int) -> None:
        """An owner said this node's group is not its own. When every other owner says
        so, no one shares this node's view of the round and no part will come for the
        part it owns: stop waiting for them now rather than at the deadline."""
        session = self._sessions.get((round_, fragment))
        if session is None:
            return
        session.mismatches += 1
        if session.mismatches >= group_size - 1:
            session.full.set()

    async def _send_part(
        self,
        round_: int,
        fragment: int,
        group: list[str],
        j: int,
        lo: int,
        hi: int,
        vector: torch.Tensor,
        weight: int,
        request: bytes,
    ) -> tuple[int, torch.Tensor | None, list[str]]:
        owner = group[j]
        self.bytes_sent += len(request)
        self.tally((round_, fragment), sent=len(request))
        try:
            try:
                reply = await self.transport.call(
                    owner, RPC_NAME, request, timeout=self.settings.timeout * 2 + 5.0
                )
            except ProtocolError as exc:
                if exc.reason != "connection_lost":
                    raise
                # A stream cut before the answer came: the owner keeps the part, and the
                # same signed part again is answered with the same result.
                logger.info(
                    "round %d fragment %d part %d: retrying owner %s",
                    round_,
                    fragment,
                    j,
                    owner[:16],
                )
                self.bytes_sent += len(request)
                self.tally((round_, fragment), sent=len(request))
                reply = await self.transport.call(
                    owner, RPC_NAME, request, timeout=self.settings.timeout * 2 + 5.0
                )
            self.bytes_received += len(reply)
            self.tally((round_, fragment), received=len(reply))
        except ProtocolError as exc:
            logger.warning(
                "round %d fragment %d part %d: owner %s: %s; keeping local values",
                *(round_, fragment, j, owner[:16], exc),
            )
            if exc.detail.startswith("group_mismatch"):
                self._note_mismatch(round_, fragment, len(group))
            return j, None, []
        try:
            part, peers, weights, digests = self._check_reduced(
                reply, owner, round_, fragment, j, hi - lo
            )
            if self.commitments is not None:
                reason = self.commitments.check_result(
                    owner, round_, fragment, j, reply, peers, digests
                )
                if reason:
                    raise ProtocolError(reason, "result names inputs nobody committed", owner)
            spread = min(1000.0, max([1.0, *weights]) / max(1.0, float(weight)))
            reason = self.observer.check_reduced(
                owner, round_, fragment, j, part, vector[lo:hi], max(1.0, spread)
            )
            if reason:
                raise ProtocolError(reason, "reduced part refused", owner)
        except ProtocolError as exc:
            logger.warning(
                "round %d fragment %d part %d: refused reduced part from owner %s: %s",
                *(round_, fragment, j, owner[:16], exc),
            )
            self.observer.on_owner_refused(owner, round_, fragment, j, exc.reason)
            return j, None, []
        return j, part, peers

    def _check_reduced(
        self, reply: bytes, owner: str, round_: int, fragment: int, part: int, numel: int
    ) -> tuple[torch.Tensor, list[str], list[float], list[bytes]]:
        env = open_envelope(
            reply,
            max_bytes=self.settings.max_message_bytes,
            expected_sender=owner,
            run_id=self.settings.run_id,
            kinds=("reduced",),
            round_window=(round_, round_),
        )
        if env.header.fragment != fragment or env.header.part != part:
            raise ProtocolError("wrong_part", "reduced result for another part", owner)
        peers = env.body.get("contributors")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ProtocolError("malformed", "contributors must be a list of PeerIDs", owner)
        rejected = env.body.get("rejected", {})
        me = self.identity.peer_id
        if me not in peers and not (isinstance(rejected, dict) and me in rejected):
            # The owner answered this node's part yet says neither that it used it nor why
            # not: the signed reply plus this node's signed part prove it was left out.
            raise ProtocolError("left_out", "own contribution missing from the reduced part", owner)
        weights = env.body.get("weights", [])
        if not isinstance(weights, list) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
        ):
            raise ProtocolError("malformed", "weights must be non-negative numbers", owner)
        digests = env.body.get("digests", [])
        if not (
            isinstance(digests, list)
            and len(digests) == len(peers)
            and all(isinstance(d, bytes) for d in digests)
        ):
            raise ProtocolError("malformed", "digests must name one input per contributor", owner)
        enc = codecs.Encoded.from_wire(env.body.get("data"), max_numel=numel)
        # decode refuses NaN, inf and out-of-range scales for every codec
        vector = codecs.decode(enc, expected_numel=numel)
        return vector, peers, [float(w) for w in weights], digests


def _fields(h: Header) -> tuple[str, int, int, int, str]:
    return h.run_id, h.round, h.fragment, h.part, h.sender


def _contributors(reply: bytes) -> list[str]:
    env = open_envelope(reply)
    return list(env.body.get("contributors", []))
