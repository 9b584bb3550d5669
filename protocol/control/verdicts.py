"""Verdicts: accusations with their evidence, on the control channel's ``verdict`` topic.

A verdict names the accused, the kind of proof and the evidence: for equivocation both
signed commitments; for a bad owner the head of its signed result (a few kB whatever the
part's size) and the signed commitment of a contributor whose digest the result
misstates. Every receiver decodes the evidence here and checks it by the rules of
:mod:`verification.evidence`, and acts through its own trust policy; an accusation whose
evidence does not check out is counted and costs the accused nothing. A bad-owner
accusation whose commitment differs from the one the owner's result holds for that
contributor (or from one this node received) proves the accuser equivocated, and
convicts the accuser instead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from protocol.averaging.resultmeta import signed_result
from protocol.control.commitments import CommitmentStore
from protocol.control.commitwire import open_commit
from protocol.control.frames import ControlMessage
from protocol.errors import ProtocolError
from protocol.wire.partwire import open_evidence
from verification import evidence as rules
from verification.evidence import SignedCommit, SignedResult

if TYPE_CHECKING:
    from verification.verifier import EventSink, Verifier

__all__ = ["Convictions", "Verdicts", "check_verdict", "open_result", "result_commit"]

logger = logging.getLogger(__name__)


def open_result(
    reduced: bytes, expected_sender: str | None = None, run: str | None = None
) -> SignedResult:
    """Check an owner's signed result from its evidence bytes
    (:meth:`~protocol.wire.partwire.Part.evidence`).

    Args:
        reduced: the evidence bytes.
        expected_sender: the owner it must be signed by, when known.
        run: when set, the run it must belong to (and be a result of).

    Raises:
        ProtocolError: as :func:`~protocol.wire.partwire.open_evidence`, or
            ``wrong_kind`` for another run's message or one that is not a result.
    """
    h, meta = open_evidence(reduced, expected_sender=expected_sender)
    if run is not None and (h.run_id != run or h.kind != "reduced"):
        raise ProtocolError("wrong_kind", f"a {h.kind!r} of run {h.run_id!r}")
    return signed_result(h, meta)


def result_commit(reduced: bytes, contributor: str) -> bytes | None:
    """The commitment of ``contributor`` that an owner's signed result (evidence bytes)
    says it relied on, or None when the result holds none or does not check out."""
    try:
        result = open_result(reduced)
    except ProtocolError:
        return None
    return rules.embedded_commit(result, contributor)


@contextlib.contextmanager
def _as_evidence() -> Iterator[None]:
    """Evidence that cannot be decoded proves nothing: its refusal becomes ``bad_evidence``."""
    try:
        yield
    except ProtocolError as exc:
        raise ProtocolError("bad_evidence", f"{exc.reason}: {exc.detail}") from None


def _equivocation(evidence: Any, run: str) -> tuple[SignedCommit, SignedCommit]:
    if not (isinstance(evidence, list) and len(evidence) == 2):
        raise ProtocolError("bad_evidence", "equivocation needs exactly two commitments")
    opened = []
    for item in evidence:
        if not isinstance(item, bytes):
            raise ProtocolError("bad_evidence", "evidence items must be signed messages")
        with _as_evidence():
            opened.append(open_commit(item, run))
    return opened[0], opened[1]


def _bad_owner(evidence: Any, accused: str, run: str) -> tuple[SignedResult, SignedCommit]:
    if not isinstance(evidence, dict):
        raise ProtocolError("bad_evidence", "bad-owner evidence is a map")
    reduced, commit = evidence.get("reduced"), evidence.get("commit")
    if not isinstance(reduced, bytes) or not isinstance(commit, bytes):
        raise ProtocolError("bad_evidence", "bad-owner evidence needs a result and a commitment")
    with _as_evidence():
        return open_result(reduced, accused, run), open_commit(commit, run)


def check_verdict(kind: Any, evidence: Any, accused: Any, run: str) -> tuple[int, int]:
    """Check that ``evidence`` proves ``kind`` (one of :data:`verification.evidence.KINDS`)
    against ``accused``, as a verdict received on the channel carries them.

    Returns:
        The ``(round, fragment)`` the accused cheated in.

    Raises:
        ProtocolError: ``bad_evidence``: the evidence does not prove it.
    """
    if not isinstance(accused, str) or kind not in rules.KINDS:
        raise ProtocolError("bad_evidence", f"unknown accusation {kind!r}")
    if kind == "equivocation":
        first, second = _equivocation(evidence, run)
        return rules.check_equivocation(first, second, accused)
    result, commit = _bad_owner(evidence, accused, run)
    return rules.check_bad_owner(result, commit, accused)


class Convictions:
    """Acts on proof: once per peer (until the operator pardons it), through the verifier,
    and tells the swarm with a verdict when this node found the proof itself.

    Args:
        me: this node's PeerID (never convicted).
        verifier: acts on proven misbehaviour through the trust policy.
        publish: signs and broadcasts a verdict's body on the ``verdict`` topic.
    """

    def __init__(self, me: str, verifier: Verifier, publish: Callable[[Any], None]) -> None:
        self.me = me
        self.verifier = verifier
        self._publish = publish
        self._lock = threading.Lock()
        self._convicted: set[str] = set()

    def convict(self, peer: str, r: int, f: int, kind: str, evidence: Any, publish: bool) -> None:
        """Convict ``peer`` of ``kind`` in round ``r``, fragment ``f``; with ``publish``,
        send the verdict with its ``evidence``."""
        with self._lock:
            if peer in self._convicted or peer == self.me:
                return
            self._convicted.add(peer)
        self.verifier.convict(peer, r, f, kind)
        if publish:
            try:
                self._publish({"accused": peer, "kind": kind, "evidence": evidence})
            except ValueError:
                # Larger than a control message (a bad owner's result for a big part):
                # this node acts on its own proof; others rely on their own checks.
                logger.warning("control: %s verdict against %s too large to broadcast", kind, peer)

    def pardoned(self, peer: str) -> None:
        """The operator pardoned ``peer``: new proof of a new offence convicts it again."""
        with self._lock:
            self._convicted.discard(peer)


class Verdicts:
    """The verdicts other nodes publish: each checked here, acted on only when it holds.

    Args:
        run_id: the run every piece of evidence must belong to.
        commitments: the commitments this node received (to tell a framed owner).
        convictions: acts on what a verdict proves.
        events: the node's event log (one line per verdict ignored), or None.
    """

    def __init__(
        self,
        run_id: str,
        commitments: CommitmentStore,
        convictions: Convictions,
        events: EventSink | None,
    ) -> None:
        self.run_id = run_id
        self.commitments = commitments
        self.convictions = convictions
        self.events = events
        self.counters = {"forged_verdicts": 0, "verdicts": 0}

    def receive(self, msg: ControlMessage) -> None:
        """Check a verdict from the channel and convict the one it proves guilty."""
        body = msg.body if isinstance(msg.body, dict) else {}
        accused, kind = body.get("accused"), body.get("kind")
        self.counters["verdicts"] += 1
        try:
            r, f = check_verdict(kind, body.get("evidence"), accused, self.run_id)
        except ProtocolError as exc:
            # The accused loses nothing; the accuser signed a claim that does not hold.
            self.counters["forged_verdicts"] += 1
            logger.warning(
                "control: verdict from %s against %s ignored: %s",
                msg.sender[:16],
                str(accused)[:16],
                exc.detail,
            )
            if self.events is not None:
                self.events.write(
                    "verdict_ignored", accuser=msg.sender, accused=str(accused), reason=exc.detail
                )
            return
        if kind == "bad_owner" and self._framed(body["evidence"]):
            return
        self.convictions.convict(accused, r, f, kind, body["evidence"], False)

    def _framed(self, evidence: dict[str, bytes]) -> bool:
        """Whether bad-owner evidence rests on a commitment its sender contradicted.

        If the owner's result holds another commitment from the same sender for the same
        exchange (the one the owner relied on), or this node received one, the sender
        equivocated: it is the sender, not the owner, that is proven to have cheated.
        """
        shown = open_commit(evidence["commit"], self.run_id)
        held = self.commitments.evidence(shown.sender, *shown.exchange)
        embedded = result_commit(evidence["reduced"], shown.sender)
        other = rules.framing_commit(shown, self._opened([embedded, held]))
        if other is None:
            return False
        wires = [other.wire, shown.wire]
        self.convictions.convict(
            shown.sender, shown.round, shown.fragment, "equivocation", wires, True
        )
        return True

    def _opened(self, wires: list[bytes | None]) -> Iterator[SignedCommit]:
        """The commitments among ``wires`` that check out (the others prove nothing)."""
        for wire in wires:
            if not wire:
                continue
            try:
                yield open_commit(wire, self.run_id)
            except ProtocolError:
                continue
