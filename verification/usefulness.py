"""Useful-work checks: what a contribution does to the loss, judged by sampled checkers.

Screens compare a contribution with the rest of its group and cannot see one that looks
like everyone else's but does no good (an idle member, training on the wrong data, last
round's change sent again). A check measures its effect instead, as Templar's Gauntlet
does: the contribution applied to the global parameters it was computed against, the
loss before and after on batches of the contributor's *assigned* data (which it should
have trained on) and on batches of the shared validation set. A member that trained on
its assignment gains more on it than on held-out text; one that did not gains no more
there than anywhere else, and one that trained on garbage raises the validation loss.

Everything here is reproducible by any node of the group, after the fact:

- the **assignment seed** of a round's exchange (:func:`assignment_seed`) is a hash of
  the global digest the group's members agree on after the round's outer step and of the
  round's contributors. That digest is a function of every committed part of the round,
  so no one can compute the seed before the commit phase closed and the parts were
  reduced; every member of the group computes the same one after.
- who checks whom (:func:`checkers_for`) and which batches (:func:`batch_plan`) follow
  from the seed;
- a checker signs a :class:`CheckRecord` (peer, round, contribution digest, global
  digest, seed, losses); another node recomputes the losses (a deterministic fp32
  forward on the CPU) and accepts them within :data:`LOSS_RTOL`;
- :class:`Scores` turns a peer's records into a standing: a record *passes* when the
  contribution lowers the loss on the assigned batches by more than on validation
  (:func:`passes`), and a peer is flagged once the upper confidence bound of its pass
  rate (Wilson, one-sided 95 %) falls below the policy's ``check_pass_rate``.

This module knows neither the model nor the network: the node measures losses and
fetches contributions (``node.checks``), and hands the numbers here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from verification.identity import Identity, verify

__all__ = [
    "LOSS_ATOL",
    "LOSS_RTOL",
    "MAX_RECORD_BYTES",
    "CheckRecord",
    "RecordError",
    "Scores",
    "assignment_seed",
    "batch_plan",
    "checkers_for",
    "contribution_digest",
    "open_record",
    "passes",
    "reproduces",
    "wilson_upper",
]

_SEED_DOMAIN = b"atoll/check-seed/v1\0"
_RECORD_DOMAIN = b"atoll/check/v1\0"
_VERSION = 1

LOSS_RTOL = 1e-4
"""Relative tolerance between a record's losses and a recomputation: fp32 sums over a
batch agree to about 1e-6 relative across thread counts; 1e-4 leaves room and is still
far below any gain a check relies on (about 1e-2 nats)."""
LOSS_ATOL = 1e-6
"""Absolute tolerance, for losses near zero."""
MAX_RECORD_BYTES = 4096
"""A signed record is about 600 bytes; anything above this is refused unread."""
_Z = 1.645
"""One-sided 95 % for the Wilson bound of a peer's pass rate."""


class RecordError(ValueError):
    """A check record that is malformed, badly signed, or not of this run."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def assignment_seed(
    run_id: str, round_: int, fragment: int, global_digest: str, contributors: Iterable[str]
) -> bytes:
    """The seed of the checks of exchange ``(round_, fragment)``: 32 bytes.

    Args:
        global_digest: the fragment's global values after the round's outer step, as
            every member of the group holds them (hex).
        contributors: the peers whose parts the round reduced (any order).
    """
    h = hashlib.sha256(_SEED_DOMAIN)
    for item in (run_id, str(int(round_)), str(int(fragment)), global_digest):
        h.update(item.encode() + b"\0")
    for peer in sorted(set(contributors)):
        h.update(peer.encode() + b"\0")
    return h.digest()


def _rank(seed: bytes, *keys: str) -> bytes:
    return hashlib.sha256(seed + "\0".join(keys).encode()).digest()


def checkers_for(seed: bytes, contributor: str, group: Sequence[str], count: int) -> list[str]:
    """The ``count`` members of ``group`` other than ``contributor`` that check it, in an
    order only the seed decides (fewer when the group is smaller)."""
    others = sorted({m for m in group if m != contributor})
    others.sort(key=lambda m: _rank(seed, "checker", contributor, m))
    return others[: max(0, count)]


def batch_plan(
    seed: bytes, contributor: str, checker: str, claimed: int, count: int, val_batches: int
) -> tuple[list[int], list[int]]:
    """Which batches ``checker``'s check of ``contributor`` measures: ``count`` indices
    among the ``claimed`` batches of the contributor's assignment, and ``count`` among
    ``val_batches`` validation batches (distinct where there are enough; sorted). Each
    checker draws its own, so two checkers' records are two samples, not one twice."""

    def pick(kind: str, n: int) -> list[int]:
        if n <= 0:
            return []
        chosen: list[int] = []
        k = 0
        while len(chosen) < min(count, n) and k < 64 * count:
            word = _rank(seed, kind, contributor, checker, str(k))
            index = struct.unpack(">Q", word[:8])[0] % n
            if index not in chosen:
                chosen.append(index)
            k += 1
        return sorted(chosen)

    return pick("assigned", claimed), pick("validation", val_batches)


def contribution_digest(part_digests: Sequence[bytes]) -> str:
    """One hex digest for a contribution from its signed parts' digests, in part order."""
    h = hashlib.sha256(b"atoll/contribution/v1\0")
    for d in part_digests:
        h.update(d)
    return h.hexdigest()


@dataclass(frozen=True)
class CheckRecord:
    """What a checker measured of one peer's contribution to one exchange.

    Losses are mean cross-entropies in nats per token, ``before`` at the global values
    the contribution was computed against and ``after`` with it applied; ``assigned``
    ones on the contributor's assigned batches (None when the run checks validation only),
    ``validation`` ones on validation batches.
    """

    checker: str
    peer: str
    run: str
    round: int
    fragment: int
    contribution: str
    global_digest: str
    seed: str
    claimed: int
    assigned: tuple[float, float] | None
    validation: tuple[float, float]
    signature: bytes = field(default=b"", compare=False)

    def body(self) -> bytes:
        """The signed bytes (every field but the signature)."""
        fields = asdict(self)
        fields.pop("signature")
        fields["v"] = _VERSION
        return msgpack.packb(fields, use_bin_type=True)

    def signed(self, identity: Identity) -> CheckRecord:
        """This record signed by ``identity`` (which must be its checker)."""
        if identity.peer_id != self.checker:
            raise ValueError("a record is signed by its checker")
        digest = hashlib.sha256(self.body()).digest()
        return _replace(self, signature=identity.sign(_RECORD_DOMAIN + digest))

    def to_bytes(self) -> bytes:
        """The record on the wire: ``msgpack([body, signature])``."""
        return msgpack.packb([self.body(), self.signature], use_bin_type=True)

    @property
    def key(self) -> tuple[str, str, int, int]:
        """One record per (checker, peer, round, fragment)."""
        return self.checker, self.peer, self.round, self.fragment

    @property
    def gains(self) -> tuple[float | None, float]:
        """Loss drops (positive: the contribution helped) on assigned and validation
        batches."""
        a = None if self.assigned is None else self.assigned[0] - self.assigned[1]
        return a, self.validation[0] - self.validation[1]


def _replace(record: CheckRecord, **changes: Any) -> CheckRecord:
    fields = asdict(record)
    fields.update(changes)
    for k in ("assigned", "validation"):
        if fields[k] is not None:
            fields[k] = tuple(fields[k])
    return CheckRecord(**fields)


def _pair(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise RecordError("malformed", f"{name} must be two losses")
    out = []
    for v in value:
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise RecordError("malformed", f"{name} losses must be finite numbers")
        out.append(float(v))
    return out[0], out[1]


_TEXT = ("checker", "peer", "run", "contribution", "global_digest", "seed")
_INTS = ("round", "fragment", "claimed")


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
        raise RecordError("malformed", "not a version-1 record")
    if not isinstance(signature, bytes) or set(fields) != {
        *_TEXT,
        *_INTS,
        "assigned",
        "validation",
    }:
        raise RecordError("malformed", "fields missing or unknown")
    if not all(isinstance(fields[k], str) and len(fields[k]) <= 128 for k in _TEXT):
        raise RecordError("malformed", "text fields must be short strings")
    if not all(isinstance(fields[k], int) and 0 <= fields[k] < 2**53 for k in _INTS):
        raise RecordError("malformed", "round, fragment and claimed must be non-negative")
    assigned = None if fields["assigned"] is None else _pair(fields["assigned"], "assigned")
    record = CheckRecord(
        **{k: fields[k] for k in (*_TEXT, *_INTS)},
        assigned=assigned,
        validation=_pair(fields["validation"], "validation"),
        signature=signature,
    )
    if record.run != run:
        raise RecordError("wrong_run", f"a record of run {record.run!r}")
    digest = hashlib.sha256(body).digest()
    if not verify(record.checker, _RECORD_DOMAIN + digest, signature):
        raise RecordError("bad_signature", f"not signed by its checker {record.checker}")
    return record


def reproduces(record: CheckRecord, mine: CheckRecord) -> bool:
    """True when ``mine`` (measured by this node on the same contribution, global state
    and batches) confirms ``record``'s losses within the tolerance."""
    if (record.peer, record.round, record.fragment) != (mine.peer, mine.round, mine.fragment):
        return False
    if (record.contribution, record.global_digest, record.seed) != (
        mine.contribution,
        mine.global_digest,
        mine.seed,
    ):
        return False
    if (record.assigned is None) != (mine.assigned is None):
        return False
    pairs = [(record.validation, mine.validation)]
    if record.assigned is not None and mine.assigned is not None:
        pairs.append((record.assigned, mine.assigned))
    return all(
        math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL)
        for theirs, ours in pairs
        for a, b in zip(theirs, ours, strict=True)
    )


def passes(record: CheckRecord) -> tuple[bool, str]:
    """Whether a record speaks for its contribution, and why not.

    With assigned data it passes when the contribution lowers the loss on the assigned
    batches, and by more than on validation batches: an idle, copied or mis-trained
    contribution gains no more on the contributor's own assignment than on any text.
    Without (``trust.check_assigned = false``) it passes when it lowers the validation
    loss. A late, honest update can leave the validation loss a hair higher on a few
    batches; it still passes on its assigned ones.
    """
    on_assigned, on_val = record.gains
    if on_assigned is None:
        if on_val <= 0:
            return False, f"does not lower validation loss ({on_val:+.4f} nats)"
        return True, ""
    if on_assigned <= max(on_val, 0.0):
        return False, (
            f"gains {on_assigned:+.4f} nats on its assigned data, against "
            f"{on_val:+.4f} on validation"
        )
    return True, ""


def wilson_upper(passed: int, total: int, z: float = _Z) -> float:
    """The upper Wilson bound of a pass rate of ``passed`` of ``total`` (1 with none)."""
    if total <= 0:
        return 1.0
    p = passed / total
    denom = 1 + z * z / total
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return min(1.0, (centre + spread) / denom)


@dataclass
class _Peer:
    results: deque[tuple[tuple[str, str, int, int], bool, str]]


class Scores:
    """Per peer, its last ``window`` judged records and whether it is flagged.

    Args:
        min_records: records needed before a peer can be flagged.
        pass_rate: a peer is flagged once the upper bound of its pass rate is below this.
        window: records kept per peer (the newest).
    """

    def __init__(self, min_records: int, pass_rate: float, window: int = 12) -> None:
        self.min_records = min_records
        self.pass_rate = pass_rate
        self.window = window
        self._peers: dict[str, _Peer] = {}

    def add(self, record: CheckRecord) -> tuple[bool, str]:
        """Count a record (once per checker, peer, round and fragment); whether it passed."""
        ok, why = passes(record)
        peer = self._peers.setdefault(record.peer, _Peer(deque(maxlen=self.window)))
        if any(key == record.key for key, _, _ in peer.results):
            return ok, why
        peer.results.append((record.key, ok, why))
        return ok, why

    def score(self, peer: str) -> dict[str, Any]:
        """``{"records", "passed", "upper", "flagged", "last_failure"}`` for ``peer``."""
        results = list(self._peers[peer].results) if peer in self._peers else []
        passed = sum(ok for _, ok, _ in results)
        upper = wilson_upper(passed, len(results))
        failures = [why for _, ok, why in results if not ok]
        return {
            "records": len(results),
            "passed": passed,
            "upper": round(upper, 4),
            "flagged": len(results) >= self.min_records and upper < self.pass_rate,
            "last_failure": failures[-1] if failures else "",
        }

    def flagged(self) -> set[str]:
        """Peers whose records say they do no useful work."""
        return {p for p in self._peers if self.score(p)["flagged"]}

    def all(self) -> dict[str, dict[str, Any]]:
        """Every scored peer's :meth:`score`."""
        return {p: self.score(p) for p in sorted(self._peers)}
