"""The signed fields of an owner's reduced result: who is in it, and on what inputs.

An owner signs, beside its result's codec fields, what the result is of
(``content``), its ``contributors`` in the order it reduced them, their capped
``weights``, the ``digests`` of the signed parts it took from them, the members it left
out with why (``rejected``) and, with a commit phase, each contributor's signed
commitment as it holds it (``commits``). This module is the one place that knows these
fields: :func:`result_fields` writes them; :func:`head_fields` and
:func:`trailer_fields` are what the head and the trailer of a result streamed back sign;
:func:`read_result` reads them for a member, checking what it relies on
(:func:`judge_result` checks a whole result: its fields, the commitments it names,
its values and their plausibility), and
:func:`signed_result` reads them as evidence, as signed, for the rules of proof
(:mod:`verification.evidence`, which judge records and never parse a result).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.hooks import Commitments
from protocol.averaging.parts import AllReduceKey
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.partwire import Part
from verification.evidence import SignedResult
from verification.records import Contribution

if TYPE_CHECKING:
    from protocol.wire.messages import Header

__all__ = [
    "ResultFields",
    "head_fields",
    "owner_fields",
    "judge_result",
    "read_result",
    "result_fields",
    "signed_result",
    "trailer_fields",
]

logger = logging.getLogger(__name__)

_HEAD_FIELDS = ("content",)
"""The result's own fields a streamed result's head names (known before it is reduced)."""


@dataclass(frozen=True)
class ResultFields:
    """A reduced result's fields as a member reads them.

    Attributes:
        contributors: the members in the result, in the order the owner reduced them.
        weights: their weights as the owner used them.
        digests: the digest of each contributor's signed part (one per contributor).
        rejected: members the owner left out, with why (as signed; only looked up).
    """

    contributors: list[str]
    weights: list[float]
    digests: list[bytes]
    rejected: dict


def result_fields(
    content: str,
    kept: Sequence[Contribution],
    rejected: dict[str, str],
    commits: list[bytes] | None = None,
) -> dict[str, Any]:
    """The fields an owner signs for a result reduced from ``kept`` (in that order);
    ``commits`` only when the exchange has a commit phase."""
    meta: dict[str, Any] = {
        "content": content,
        "contributors": [c.peer for c in kept],
        "weights": [c.weight for c in kept],
        "digests": [c.digest for c in kept],
        "rejected": rejected,
    }
    if commits is not None:
        meta["commits"] = commits
    return meta


def owner_fields(
    commitments: Commitments | None,
    key: AllReduceKey,
    kept: Sequence[Contribution],
    rejected: dict[str, str],
) -> dict[str, Any]:
    """:func:`result_fields` of an owner's result of ``key`` reduced from ``kept``, with
    what each contributor committed to as this owner holds it (with a commit phase)."""
    round_, fragment, content = key
    commits = None
    if commitments is not None:
        commits = [commitments.evidence(c.peer, round_, fragment, content) for c in kept]
    return result_fields(content, kept, rejected, commits)


def head_fields(content: str) -> dict[str, Any]:
    """The result's own fields the head of a result streamed back signs (the trailer
    signs the rest, once the result is reduced)."""
    return {"content": content}


def trailer_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """What the trailer of a result streamed back signs: every field its head does not."""
    return {k: v for k, v in meta.items() if k not in _HEAD_FIELDS}


def read_result(meta: dict[str, Any], owner: str, content: str) -> ResultFields:
    """The fields of ``owner``'s result of ``content``, checked.

    Raises:
        ProtocolError: ``wrong_part``: a result of another content; ``malformed``
            contributors (not a list of PeerIDs), weights (not non-negative numbers) or
            digests (not one bytes per contributor).
    """
    if meta.get("content") != content:
        raise ProtocolError("wrong_part", f"a result of {meta.get('content')!r}", owner)
    peers = meta.get("contributors")
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise ProtocolError("malformed", "contributors must be a list of PeerIDs", owner)
    weights = meta.get("weights", [])
    if not isinstance(weights, list) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
    ):
        raise ProtocolError("malformed", "weights must be non-negative numbers", owner)
    digests = meta.get("digests", [])
    if not (
        isinstance(digests, list)
        and len(digests) == len(peers)
        and all(isinstance(d, bytes) for d in digests)
    ):
        raise ProtocolError("malformed", "digests must name one input per contributor", owner)
    rejected = meta.get("rejected", {})
    return ResultFields(
        peers, [float(w) for w in weights], digests, rejected if isinstance(rejected, dict) else {}
    )


def signed_result(header: Header, meta: dict[str, Any]) -> SignedResult:
    """What the result with ``header`` and ``meta`` (its signature checked) says it
    reduced, as evidence: the values as signed, their shapes left to the rules of proof
    (an owner is answerable for a malformed result it signed)."""
    return SignedResult(
        owner=header.sender,
        round=header.round,
        fragment=header.fragment,
        part=header.part,
        content=meta.get("content"),
        contributors=meta.get("contributors"),
        digests=meta.get("digests"),
        commits=meta.get("commits"),
    )


def judge_result(
    ctx: AllReduceContext,
    reply: Part,
    owner: str,
    at: AllReduceKey,
    j: int,
    numel: int,
    own: torch.Tensor,
    weight: int,
) -> tuple[torch.Tensor, list[str]]:
    """``owner``'s signed result for part ``j``, checked against the commitments and this
    node's own contribution ``own`` (of ``weight`` tokens): its values and who is in
    them. Runs in the all-reduce's worker thread (decoding checks every value).

    Raises:
        ProtocolError: the result is refused, and why.
    """
    round_, fragment, content = at
    part, norm, fields = _read_values(ctx, reply, owner, at, j, numel)
    peers = fields.contributors
    commitments = ctx.commitments
    if commitments is not None:
        evidence = reply.evidence()
        reason = commitments.check_result(
            owner, round_, fragment, j, evidence, peers, fields.digests, content
        )
        if reason:
            commitments.convict_owner(owner, round_, fragment, evidence, content)
            raise ProtocolError(reason, "result names inputs nobody committed", owner)
    spread = min(1000.0, max([1.0, *fields.weights]) / max(1.0, float(weight)))
    included = ctx.identity.peer_id in peers
    reason = ctx.judge.check_reduced(
        owner, round_, fragment, j, part, own, max(1.0, spread), included, norm, content=content
    )
    if reason:
        raise ProtocolError(reason, "reduced part refused", owner)
    return part, peers


def _read_values(
    ctx: AllReduceContext, env: Part, owner: str, at: AllReduceKey, part: int, numel: int
) -> tuple[torch.Tensor, float, ResultFields]:
    round_, fragment, content = at
    if env.header.fragment != fragment or env.header.part != part:
        raise ProtocolError("wrong_part", "reduced result for another part", owner)
    fields = read_result(env.meta, owner, content)
    me = ctx.identity.peer_id
    if me not in fields.contributors and me not in fields.rejected:
        # Signed before this node's part arrived (a late part): the result stands for
        # every member alike, so it is taken, without this node's contribution.
        logger.info(
            "round %d fragment %d part %d: owner %s's result came without this node's part",
            *(round_, fragment, part, owner[:16]),
        )
    enc = codecs.Encoded.from_meta(env.meta, env.body, max_numel=numel)
    ctx.check_codec(enc, content, result=True)
    # decode refuses NaN, inf and out-of-range scales for every codec; the values
    # stay a view of the received bytes until they are assembled into the output
    vector, norm = codecs.decode_with_norm(enc, expected_numel=numel, copy=False)
    return vector, norm, fields
