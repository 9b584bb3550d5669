"""A member's parts, signed: one per owner, or in a gather one for every member.

Built before anything is sent, each body a view of the member's contribution (not a
copy); the fault mode only transforms them (:mod:`protocol.averaging.hooks`). A part
carries the member's group, owners and token weight in its signed head, and for an
``update`` the claim of what it was trained on (read by the useful-work checks).
"""

from __future__ import annotations

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.gather import GATHER
from protocol.averaging.hooks import FaultInjection
from protocol.averaging.parts import AllReduceKey, PartPlan
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart, seal_part
from verification.identity import Identity

__all__ = ["part_fields", "seal_for", "seal_with", "sign_part", "sign_parts"]


def sign_parts(
    ctx: AllReduceContext,
    key: AllReduceKey,
    plan: PartPlan,
    vector: torch.Tensor,
    weight: int,
    claim: dict | None,
) -> tuple[dict[int, SealedPart], dict[int, SealedPart]]:
    """The signed parts this member sends, by owner, and those it commits to (built
    before anything is sent; each body is a view of ``vector``, not a copy); kept for
    the useful-work checks when the context keeps sent parts."""
    if plan.gather:
        # one signed part, this node's whole vector, the same bytes to every member
        # (committed once: no member can be sent other values than the rest)
        header, meta, enc = part_fields(ctx, key, plan, plan.index, vector, weight, claim)
        part = seal_with(ctx.faults, ctx.identity, header, meta, enc)
        requests = {
            j: seal_for(ctx.faults, ctx.identity, j, part, header, meta, enc)
            for j in range(len(plan.owners))
            if j != plan.index
        }
        committed = {plan.index: part}
    else:
        requests = {
            j: sign_part(ctx, key, plan, j, vector[lo:hi], weight, claim)
            for j, (lo, hi) in enumerate(plan.bounds)
            if j != plan.index
        }
        committed = requests
    if ctx.sent is not None:
        own = {}
        if plan.is_owner and not plan.gather:
            lo, hi = plan.bounds[plan.index]
            own[plan.index] = sign_part(ctx, key, plan, plan.index, vector[lo:hi], weight, claim)
        ctx.sent.keep(key, {**committed, **own})
    return requests, committed


def sign_part(
    ctx: AllReduceContext,
    at: AllReduceKey,
    plan: PartPlan,
    j: int,
    values: torch.Tensor,
    weight: int,
    claim: dict | None = None,
) -> SealedPart:
    """The signed part message for owner ``j`` (its body is a view of ``values``)."""
    header, meta, enc = part_fields(ctx, at, plan, j, values, weight, claim)
    return seal_with(ctx.faults, ctx.identity, header, meta, enc)


def part_fields(
    ctx: AllReduceContext,
    at: AllReduceKey,
    plan: PartPlan,
    j: int,
    values: torch.Tensor,
    weight: int,
    claim: dict | None,
) -> tuple[Header, dict, codecs.Encoded]:
    """The header, fields and encoded values of the part for owner ``j`` (in a gather
    ``j`` is this node's own index, the one part it sends everyone); an ``update``'s
    ``claim`` of work goes into its head."""
    round_, fragment, content = at
    enc = ctx.encode(values, content)
    header = Header("part", ctx.settings.run_id, round_, fragment, j, ctx.identity.peer_id)
    meta = {
        "content": content,
        "group": plan.group,
        "owners": plan.owners,
        "weight": int(weight),
    }
    if claim is not None and content == "update":
        meta["work"] = claim
    if plan.gather:
        meta["exchange"] = GATHER
    return header, meta, enc


def seal_with(
    faults: FaultInjection,
    identity: Identity,
    header: Header,
    meta: dict,
    encoded: codecs.Encoded,
) -> SealedPart:
    """The signed part this node sends: ``faults`` may change its fields and values
    before signing and the signed message after."""
    meta, encoded = faults.part(meta, encoded)
    sealed = seal_part(identity, header, {**meta, **encoded.meta()}, encoded.payload)
    return faults.sealed(header, meta, sealed)


def seal_for(
    faults: FaultInjection,
    identity: Identity,
    j: int,
    part: SealedPart,
    header: Header,
    meta: dict,
    encoded: codecs.Encoded,
) -> SealedPart:
    """In a gather, the one signed ``part`` (made by :func:`seal_with` from ``header``,
    ``meta`` and ``encoded``) as member ``j`` gets it: itself, unless ``faults`` signs
    member ``j`` other fields."""
    fields = faults.sent_to(j, header, meta)
    if fields is meta:
        return part
    return seal_part(identity, header, {**fields, **encoded.meta()}, encoded.payload)
