"""Useful-work checks: who checks whom on which batches, and the signed records of what
a checker measured.

Screens compare a contribution with the rest of its group and cannot see one that looks
like everyone else's but does no good (an idle member, one that trained a tenth of the
steps it claims, training on the wrong data, last round's change sent again). A check
measures its effect instead: the contribution applied to the *round's base* (the values
every member of its group held before the round's outer steps), the loss before and
after on a sample of the batches the contributor claims it trained (its *assigned*
batches, which anyone holding the run's tokens can draw again) and on *control* batches
drawn for the whole exchange. The checker measures its own contribution to the same
exchange on the same control batches as the reference of honest work.
:mod:`verification.workscores` turns a record into verdicts.

Everything here is reproducible by any member of the group, after the fact:

- the **round's base** is, for every fragment, the value the group held before the
  round's outer step: the group's mean copy where the group mixes, else the global copy
  every member announced with the same digest; :func:`round_base_digest` names it. Groups
  are formed per round, not per fragment (:mod:`protocol.averaging.grouping`), so the
  members of one group share the base of every fragment, in every layout;
- the **seed** of an exchange (:func:`assignment_seed`) hashes that base, the digest of
  the exchange's reduced result and its contributors: no one knows it before the commit
  phase closed and the parts were reduced, and every member computes the same one after;
- which fragment of each contributor is checked in a round (:func:`fragments_checked`),
  who checks it (:func:`checkers_for`), which windows of its claimed batches
  (:func:`window_plan`) and which control windows (:func:`control_key`) follow from the
  seed;
- a checker signs a :class:`CheckRecord` (the contribution's and its own digests, the
  base, the seed, the claims and every loss); another member recomputes the losses (a
  deterministic fp32 forward) and accepts them within :data:`LOSS_RTOL`.

This module knows neither the model nor the network: the node measures losses and
fetches contributions (``node.checks``), and hands the numbers here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import blake3
import msgpack
import torch

from verification.identity import Domain, Identity

__all__ = [
    "LOSS_ATOL",
    "LOSS_RTOL",
    "MAX_RECORD_BYTES",
    "CheckRecord",
    "RecordError",
    "assignment_seed",
    "checkers_for",
    "contribution_digest",
    "control_key",
    "fragment_digest",
    "fragments_checked",
    "open_record",
    "reproduces",
    "round_base_digest",
    "window_plan",
]

_SEED_DOMAIN = b"atoll/check-seed/v2\0"
_RECORD = Domain(b"atoll/check/v2\0")
_VERSION = 2

LOSS_RTOL = 1e-4
"""Relative tolerance between a record's losses and a recomputation: fp32 sums over a
batch agree to about 1e-6 relative across thread counts; 1e-4 leaves room and is still
far below any gain a check relies on (about 1e-2 nats)."""
LOSS_ATOL = 1e-6
"""Absolute tolerance, for losses near zero."""
MAX_RECORD_BYTES = 16384
"""A signed record of 16 claimed windows of each member and 32 control windows is about
2.2 KB; anything above this is refused unread."""
MAX_WINDOWS = 128
"""Windows of any kind one record may hold (``trust.check_windows`` is at most 64)."""


class RecordError(ValueError):
    """A check record that is malformed, badly signed, or not of this run."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def fragment_digest(vector: torch.Tensor) -> str:
    """Hex BLAKE3 of a fragment's float32 values (hashed in place on the CPU)."""
    data = vector.detach().float().contiguous().cpu().numpy().view("uint8").data
    return blake3.blake3(data).hexdigest()


def round_base_digest(fragments: Sequence[str]) -> str:
    """One digest for a round's base from its fragments' digests, in fragment order."""
    h = hashlib.sha256(b"atoll/round-base/v1\0")
    for d in fragments:
        h.update(d.encode() + b"\0")
    return h.hexdigest()


def assignment_seed(
    run_id: str,
    round_: int,
    fragment: int,
    base: str,
    result: str,
    contributors: Iterable[str],
) -> bytes:
    """The seed of the checks of exchange ``(round_, fragment)``: 32 bytes.

    Args:
        base: the round's base digest (:func:`round_base_digest`), as the group holds it.
        result: the digest of the exchange's reduced pseudo-gradient.
        contributors: the peers whose parts the exchange reduced (any order).
    """
    h = hashlib.sha256(_SEED_DOMAIN)
    for item in (run_id, str(int(round_)), str(int(fragment)), base, result):
        h.update(item.encode() + b"\0")
    for peer in sorted(set(contributors)):
        h.update(peer.encode() + b"\0")
    return h.digest()


def _rank(seed: bytes, *keys: str) -> bytes:
    return hashlib.sha256(seed + "\0".join(keys).encode()).digest()


def fragments_checked(base: str, round_: int, peer: str, fragments: int, count: int) -> set[int]:
    """The ``count`` fragments of ``peer``'s round-``round_`` contributions that are checked
    (all of them when ``count >= fragments``): drawn from the round's base, which only the
    round's end fixes, so a contributor cannot know beforehand which of its fragments
    will be looked at."""
    if count >= fragments:
        return set(range(fragments))
    seed = hashlib.sha256(f"atoll/check-fragments/v1\0{base}\0{int(round_)}".encode()).digest()
    order = sorted(range(fragments), key=lambda f: _rank(seed, peer, str(f)))
    return set(order[: max(0, count)])


def checkers_for(seed: bytes, contributor: str, group: Sequence[str], count: int) -> list[str]:
    """The ``count`` members of ``group`` other than ``contributor`` that check it, in an
    order only the seed decides (fewer when the group is smaller)."""
    others = sorted({m for m in group if m != contributor})
    others.sort(key=lambda m: _rank(seed, "checker", contributor, m))
    return others[: max(0, count)]


def window_plan(
    seed: bytes, contributor: str, checker: str, claimed: int, batch: int, count: int
) -> list[tuple[int, int]]:
    """Which windows of ``contributor``'s claim ``checker`` measures: ``count``
    ``(batch, window)`` pairs, each in a different one of the ``claimed`` batches (fewer
    when the claim is shorter) and at a window of it below ``batch``, sorted. Each checker
    draws its own, so two checkers' records are two samples, not one twice."""
    if claimed <= 0 or count <= 0 or batch <= 0:
        return []
    chosen: dict[int, int] = {}
    k = 0
    while len(chosen) < min(count, claimed) and k < 64 * count:
        word = _rank(seed, "assigned", contributor, checker, str(k))
        index, window = struct.unpack(">QQ", word[:16])
        chosen.setdefault(index % claimed, window % batch)
        k += 1
    return sorted(chosen.items())


def control_key(seed: bytes) -> str:
    """What keys the control windows of an exchange: the same for every checker of it, so
    every contribution of the exchange is measured on the very same text."""
    return "control:" + seed.hex()


def contribution_digest(part_digests: Sequence[bytes]) -> str:
    """One hex digest for a contribution from its signed parts' digests, in part order."""
    h = hashlib.sha256(b"atoll/contribution/v1\0")
    for d in part_digests:
        h.update(d)
    return h.hexdigest()


Pair = tuple[float, float]
Quad = tuple[float, float, float, float]


@dataclass(frozen=True)
class CheckRecord:
    """What a checker measured of one peer's contribution to one exchange.

    Losses are mean cross-entropies in nats per window token, before a contribution
    (the round's base, where the group mixed copies with the exchange's fragment at the
    copy its member sent) and after it (subtracted from that fragment: a
    pseudo-gradient is ``global - local``).

    Attributes:
        contribution: digest of the checked contribution's signed parts (and its copy's,
            where the group mixed).
        reference: the same of the checker's own contribution to the exchange.
        base: the round's base digest; ``result``: the exchange's reduced result's.
        seed: the exchange's seed (hex).
        claimed: the batches the contribution's signed claim covers (all ranks).
        reference_claimed: the batches the checker's own claim covers.
        assigned: ``(before, after)`` on each sampled window of the contribution's
            claimed batches (none when the run checks validation only).
        reference_assigned: ``(before, reference after)`` on each sampled window of the
            checker's own claimed batches (none when the run checks validation only).
        control: ``(before, after, reference before, reference after)`` on each control
            window.
    """

    checker: str
    peer: str
    run: str
    round: int
    fragment: int
    contribution: str
    reference: str
    base: str
    result: str
    seed: str
    claimed: int
    reference_claimed: int
    assigned: tuple[Pair, ...]
    reference_assigned: tuple[Pair, ...]
    control: tuple[Quad, ...]
    signature: bytes = field(default=b"", compare=False)

    def body(self) -> bytes:
        """The signed bytes (every field but the signature)."""
        fields = asdict(self)
        fields.pop("signature")
        for name in ("assigned", "reference_assigned", "control"):
            fields[name] = [list(row) for row in getattr(self, name)]
        fields["v"] = _VERSION
        return msgpack.packb(fields, use_bin_type=True)

    def signed(self, identity: Identity) -> CheckRecord:
        """This record signed by ``identity`` (which must be its checker)."""
        if identity.peer_id != self.checker:
            raise ValueError("a record is signed by its checker")
        digest = hashlib.sha256(self.body()).digest()
        return _replace(self, signature=_RECORD.sign(identity, digest))

    def to_bytes(self) -> bytes:
        """The record on the wire: ``msgpack([body, signature])``."""
        return msgpack.packb([self.body(), self.signature], use_bin_type=True)

    @property
    def key(self) -> tuple[str, str, int, int]:
        """One record per (checker, peer, round, fragment)."""
        return self.checker, self.peer, self.round, self.fragment

    @property
    def exchange(self) -> tuple[int, int]:
        return self.round, self.fragment


def _replace(record: CheckRecord, **changes: Any) -> CheckRecord:
    fields = {f: getattr(record, f) for f in record.__dataclass_fields__}
    fields.update(changes)
    return CheckRecord(**fields)


def _losses(value: Any, name: str, width: int) -> tuple[tuple[float, ...], ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_WINDOWS:
        raise RecordError("malformed", f"{name} must be a list of at most {MAX_WINDOWS}")
    out = []
    for row in value:
        if not isinstance(row, list | tuple) or len(row) != width:
            raise RecordError("malformed", f"each {name} entry holds {width} losses")
        losses = []
        for v in row:
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise RecordError("malformed", f"{name} losses must be finite numbers")
            losses.append(float(v))
        out.append(tuple(losses))
    return tuple(out)


_TEXT = ("checker", "peer", "run", "contribution", "reference", "base", "result", "seed")
_INTS = ("round", "fragment", "claimed", "reference_claimed")


def open_record(data: bytes, run: str) -> CheckRecord:
    """Parse and authenticate a record from the wire.

    Raises:
        RecordError: ``oversized``, ``malformed``, ``wrong_run`` or ``bad_signature``.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError("oversized", f"{len(data)} bytes > {MAX_RECORD_BYTES}")
    try:
        body, signature = msgpack.unpackb(data, raw=False)
        fields = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise RecordError("malformed", f"not a record: {type(exc).__name__}") from None
    if not isinstance(fields, dict) or fields.pop("v", None) != _VERSION:
        raise RecordError("malformed", f"not a version-{_VERSION} record")
    if not isinstance(signature, bytes) or set(fields) != {
        *_TEXT,
        *_INTS,
        "assigned",
        "reference_assigned",
        "control",
    }:
        raise RecordError("malformed", "fields missing or unknown")
    if not all(isinstance(fields[k], str) and len(fields[k]) <= 128 for k in _TEXT):
        raise RecordError("malformed", "text fields must be short strings")
    if not all(
        isinstance(fields[k], int) and not isinstance(fields[k], bool) and 0 <= fields[k] < 2**53
        for k in _INTS
    ):
        raise RecordError("malformed", "round, fragment and claims must be non-negative")
    record = CheckRecord(
        **{k: fields[k] for k in (*_TEXT, *_INTS)},
        assigned=_losses(fields["assigned"], "assigned", 2),  # type: ignore[arg-type]
        reference_assigned=_losses(  # type: ignore[arg-type]
            fields["reference_assigned"], "reference_assigned", 2
        ),
        control=_losses(fields["control"], "control", 4),  # type: ignore[arg-type]
        signature=signature,
    )
    if not record.control:
        raise RecordError("malformed", "a record measures at least one control window")
    if record.run != run:
        raise RecordError("wrong_run", f"a record of run {record.run!r}")
    digest = hashlib.sha256(body).digest()
    if not _RECORD.verify(record.checker, digest, signature):
        raise RecordError("bad_signature", f"not signed by its checker {record.checker}")
    return record


_SAME = ("peer", "round", "fragment", "contribution", "reference", "base", "result", "seed")


def reproduces(record: CheckRecord, mine: CheckRecord) -> bool:
    """True when ``mine`` (measured by this node on the same contributions, base and
    batches) confirms ``record``'s losses within the tolerance."""
    if any(getattr(record, k) != getattr(mine, k) for k in _SAME):
        return False
    if (record.claimed, record.reference_claimed) != (mine.claimed, mine.reference_claimed):
        return False
    names = ("assigned", "reference_assigned", "control")
    if any(len(getattr(record, n)) != len(getattr(mine, n)) for n in names):
        return False
    rows = [pair for n in names for pair in zip(getattr(record, n), getattr(mine, n))]
    return all(
        math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL)
        for theirs, ours in rows
        for a, b in zip(theirs, ours, strict=True)
    )
