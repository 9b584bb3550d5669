"""The rules of proof: when signed statements show that a peer cheated.

A member signs a commitment to the digests of its parts before an exchange; an owner
signs its result, which names each contributor's digest (and may hold the commitment it
relied on for each). Two kinds of proof follow, and a verdict on the control channel
carries one of them:

* ``equivocation``: two commitments by one peer for the same exchange (round, fragment,
  content) that differ. The peer could show each member of its group another part.
* ``bad_owner``: an owner's signed result names, for a contributor, a digest other than
  the one that contributor's signed commitment gives. The owner misstated its input.

An equivocator can frame an honest owner: it shows the commitment the owner did not use.
:func:`framing_commit` is the answer: a second commitment from the same sender for the
same exchange (held by the owner's result or received directly) proves that the sender,
not the owner, cheated.

The rules work on plain records whose signatures the protocol layer has checked
(:class:`SignedCommit`, :class:`SignedResult`); every rule that does not hold raises
:class:`~verification.errors.VerificationError` with reason ``bad_evidence``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verification.errors import VerificationError

__all__ = [
    "KINDS",
    "SignedCommit",
    "SignedResult",
    "check_bad_owner",
    "check_equivocation",
    "embedded_commit",
    "framing_commit",
    "misstated",
]

KINDS = ("equivocation", "bad_owner")
"""What a verdict may prove; each convicts the accused of ``(round, fragment)``."""


@dataclass(frozen=True)
class SignedCommit:
    """A member's commitment for one exchange, its signature, run and topic checked.

    Attributes:
        sender: the PeerID that signed it.
        round: the round of the exchange.
        fragment: the fragment of the exchange.
        content: what the exchange averages (``update`` or ``weights``).
        digests: ``{part: digest}`` the sender committed to.
        wire: the signed message, evidence anyone can check again.
    """

    sender: str
    round: int
    fragment: int
    content: str
    digests: Mapping[int, bytes]
    wire: bytes

    @property
    def exchange(self) -> tuple[int, int, str]:
        """``(round, fragment, content)``: the exchange it commits to."""
        return self.round, self.fragment, self.content


@dataclass(frozen=True)
class SignedResult:
    """What an owner's signed result for one part says it reduced, its signature checked.

    The list fields hold the values as they were signed (not yet checked for shape).

    Attributes:
        owner: the PeerID that signed it.
        round: the round of the exchange.
        fragment: the fragment of the exchange.
        part: the part it is the result of.
        content: what the exchange averaged.
        contributors: the peers whose parts it says it reduced.
        digests: each contributor's part digest, in the order of ``contributors``.
        commits: each contributor's signed commitment the owner relied on (``b""``
            for none), in the same order; None when the result holds none.
    """

    owner: str
    round: int
    fragment: int
    part: int
    content: Any
    contributors: Any
    digests: Any
    commits: Any = None


def _refuse(detail: str) -> VerificationError:
    return VerificationError("bad_evidence", detail)


def check_equivocation(first: SignedCommit, second: SignedCommit, accused: str) -> tuple[int, int]:
    """Check equivocation evidence: two commitments by ``accused`` for the same exchange,
    differing.

    Returns:
        The ``(round, fragment)`` the accused equivocated on.

    Raises:
        VerificationError: ``bad_evidence``: the commitments do not prove it.
    """
    if first.sender != accused or second.sender != accused:
        raise _refuse("a commitment is not signed by the accused")
    if first.exchange != second.exchange:
        raise _refuse("the commitments are for different exchanges")
    if first.digests == second.digests:
        raise _refuse("the commitments agree")
    return first.round, first.fragment


def check_bad_owner(result: SignedResult, commit: SignedCommit, accused: str) -> tuple[int, int]:
    """Check bad-owner evidence: ``accused``'s signed result names, for the committer,
    a digest other than the one its signed commitment gives.

    Returns:
        The ``(round, fragment)`` of the result.

    Raises:
        VerificationError: ``bad_evidence``: the result and the commitment do not prove it.
    """
    peers, digests = result.contributors, result.digests
    if (result.round, result.fragment, result.content) != commit.exchange or (
        result.part not in commit.digests
    ):
        raise _refuse("the commitment is for another exchange or part")
    if not (isinstance(peers, list) and isinstance(digests, list) and commit.sender in peers):
        raise _refuse("the result does not name the committer")
    named = digests[peers.index(commit.sender)] if len(digests) == len(peers) else None
    if commit.sender == accused or named == commit.digests[result.part]:
        raise _refuse("the result matches the commitment")
    return commit.round, commit.fragment


def embedded_commit(result: SignedResult, contributor: str) -> bytes | None:
    """The signed commitment of ``contributor`` that the owner says it relied on, or
    None when the result holds none (or holds them in a shape that does not add up)."""
    peers, commits = result.contributors, result.commits
    if not (isinstance(peers, list) and isinstance(commits, list) and len(peers) == len(commits)):
        return None
    if contributor not in peers:
        return None
    wire = commits[peers.index(contributor)]
    return wire if isinstance(wire, bytes) and wire else None


def framing_commit(shown: SignedCommit, others: Iterable[SignedCommit]) -> SignedCommit | None:
    """The first of ``others`` that, beside ``shown``, proves ``shown``'s sender
    equivocated: bad-owner evidence resting on such a commitment frames the owner.

    ``others`` are the sender's other commitments for the exchange this node knows of:
    the one the owner's result holds, and the one this node received.
    """
    for other in others:
        if other.wire == shown.wire:
            continue
        try:
            check_equivocation(other, shown, shown.sender)
        except VerificationError:
            continue  # not two differing commitments for this exchange
        return other
    return None


def misstated(
    me: str,
    committed: Mapping[int, bytes] | None,
    part: int,
    contributors: Sequence[str],
    digests: Sequence[bytes],
) -> bool:
    """Whether an owner's result for ``part`` names, for this node (``me``), a digest
    other than the one this node committed to (``committed``: its ``{part: digest}``).

    Only this node's own entry is judged: it knows exactly what it committed to and
    never commits twice, whereas another contributor's commitment could be one of two it
    signed (an equivocator framing an honest owner).
    """
    if me not in contributors:
        return False
    named = digests[list(contributors).index(me)]
    return committed is not None and part in committed and committed[part] != named
