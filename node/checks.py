"""Useful-work checks on the node: measuring what group members' contributions do to the
loss, signing what was measured, and judging the records other checkers sign.

After each exchange this node applied, :meth:`UsefulWork.exchange_done` computes the
round's assignment seed (:func:`verification.usefulness.assignment_seed`) from the global
digest the group agrees on; for every contributor it is one of the checkers of (drawn
from the exchange's contributors), it fetches the
contributor's whole committed contribution (:mod:`protocol.averaging.contributions`),
applies it to the global values it was computed against and measures the loss before and
after on the contributor's assigned batches and on validation batches. The signed record
goes to the run on the control channel's ``check`` topic once the round ended well on
this node (:meth:`UsefulWork.round_ended`).

A record from another checker is counted only once this node believes it: one of a
contribution this node checked too must name the contribution it fetched; a failing one
is always recomputed here first, a passing one with probability ``trust.check_audit``;
a record that does not reproduce costs its signer a ``bad_check_record`` violation and
counts for nothing. A node that holds no base state for the record's exchange (another
group) cannot recompute it and never acts on it when it fails. A peer whose records say
it does no useful work (:class:`verification.usefulness.Scores`) gets a ``useless_work``
violation each round it stays flagged, and the trust policy decides what that costs.

Everything runs on the training thread, right after the exchange is applied: its cost is
part of the round time the robustness benchmark reports.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch import nn

from node.catchup import state_digest
from node.data import assigned_stream
from node.trainer import mean_loss
from protocol.averaging.contributions import (
    CONTRIBUTION_RPC,
    Fetched,
    SentParts,
    open_contribution,
)
from protocol.averaging.fragments import FragmentPlan
from protocol.averaging.parts import AllReduceSettings
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from verification.identity import Identity
from verification.usefulness import (
    CheckRecord,
    RecordError,
    Scores,
    assignment_seed,
    batch_plan,
    checkers_for,
    contribution_digest,
    open_record,
    passes,
    reproduces,
)
from verification.verifier import Verifier

__all__ = ["CheckSettings", "UsefulWork"]

logger = logging.getLogger(__name__)

_BASES_KEPT = 2
"""Rounds of base states kept for recomputing others' records."""
_INBOX = 4096
"""Records waiting to be judged at most (older ones are dropped)."""

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CheckSettings:
    """The ``trust.check*`` keys and the shapes a check needs (:func:`node.settings.check_settings`)."""

    run_id: str
    checkers: int
    batches: int
    from_round: int
    min_records: int
    pass_rate: float
    audit: float
    assigned: bool
    batch_size: int
    context: int
    timeout: float


@dataclass
class _Base:
    """What this node held before an exchange's outer step: enough to recompute a check."""

    vectors: list[torch.Tensor]
    digest: str
    seed: bytes
    checkers: list[str]
    """Whom the seed draws checkers from: the exchange's contributors."""


class UsefulWork:
    """This node's useful-work checks (see the module docstring).

    Args:
        settings: the check settings.
        identity: this node's key (signs records).
        transport: fetches contributions.
        wire: the all-reduce's settings (codec, alignment, limits), the commitments'
            digests of a peer's parts (``(peer, round, fragment)``) and this node's own
            sent parts.
        verifier: where violations go.
        model: the model the losses are measured with (its values are not used).
        plan: the fragment plan (which values a fragment's vector holds).
        data: this node's train tokens and validation batches.
        publish: gossips a signed record; ``events``: the node's event log writer.
    """

    def __init__(
        self,
        settings: CheckSettings,
        identity: Identity,
        transport: Transport,
        wire: tuple[
            AllReduceSettings, Callable[[str, int, int], dict[int, bytes] | None], SentParts
        ],
        verifier: Verifier,
        model: nn.Module,
        plan: FragmentPlan,
        data: tuple[torch.Tensor, Batches],
        publish: Callable[[bytes], bool],
        events: Callable[..., None],
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.me = identity.peer_id
        self.transport = transport
        self.wire, self.committed, self.sent = wire
        self.verifier = verifier
        self.model = model
        self.device = next(model.parameters()).device
        self.plan = plan
        self.train, self.val = data
        self.publish = publish
        self.events = events
        self.scores = Scores(settings.min_records, settings.pass_rate)
        self.counts = {
            "made": 0,
            "taken": 0,
            "recomputed": 0,
            "refused": 0,
            "unserved": 0,
            "bytes_fetched": 0,
        }
        self.seconds = 0.0
        """Time spent checking (fetching and measuring), in total."""
        self._bases: dict[tuple[int, int], _Base] = {}
        self._unpublished: dict[int, list[CheckRecord]] = {}
        """This node's records waiting for their round to end well."""
        self._mine: dict[tuple[str, int, int], CheckRecord] = {}
        """This node's own records of the last rounds, by (peer, round, fragment)."""
        self._inbox: deque[tuple[str, bytes]] = deque(maxlen=_INBOX)
        self._waiting: deque[tuple[str, bytes, int]] = deque(maxlen=_INBOX)
        """Records of rounds this node has not reached yet, with their round."""
        self._newest = 0
        """The newest round this node has reached (its exchange applied, or ended)."""
        self._lock = threading.Lock()
        self._charged: set[tuple[str, int]] = set()

    # ---- inputs -------------------------------------------------------------------------

    def receive(self, sender: str, data: bytes) -> None:
        """A record gossiped by ``sender`` (any thread): judged on the training thread."""
        with self._lock:
            self._inbox.append((sender, data))

    def exchange_done(
        self,
        round_: int,
        fragment: int,
        contributors: Sequence[str],
        base: list[torch.Tensor],
        global_digest: str,
    ) -> None:
        """The exchange ``(round_, fragment)`` was applied: check whom this node checks,
        then judge the records that came in.

        Args:
            base: every fragment's global values before the exchange's outer step.
            global_digest: the fragment's global digest after it, as the group holds it.
        """
        s = self.settings
        if round_ < s.from_round:
            return
        started = time.monotonic()
        try:
            self._reached(round_ - 1)  # records of this round wait for its base
            self._exchange_done(round_, fragment, contributors, base, global_digest)
            self._reached(round_)
            self._judge_all()
        finally:
            self.seconds += time.monotonic() - started

    def _exchange_done(
        self,
        round_: int,
        fragment: int,
        contributors: Sequence[str],
        base: list[torch.Tensor],
        global_digest: str,
    ) -> None:
        s = self.settings
        seed = assignment_seed(s.run_id, round_, fragment, global_digest, contributors)
        # checkers are drawn from the round's contributors: a member left out of the
        # round (refused, quarantined) checks no one
        self._bases[(round_, fragment)] = _Base(base, state_digest(base), seed, list(contributors))
        for old in [k for k in self._bases if k[0] <= round_ - _BASES_KEPT]:
            del self._bases[old]
        for old in [k for k in self._mine if k[1] <= round_ - _BASES_KEPT]:
            del self._mine[old]
        for peer in sorted(set(contributors) - {self.me}):
            if self.me in checkers_for(seed, peer, contributors, s.checkers):
                record = self._check(peer, round_, fragment)
                if record is not None:
                    self._mine[(peer, round_, fragment)] = record
                    self._unpublished.setdefault(round_, []).append(record)

    def _reached(self, round_: int) -> None:
        """This node has reached ``round_``: records of it and before are judged now."""
        self._newest = max(self._newest, round_)
        with self._lock:
            ready = [(s, d) for s, d, r in self._waiting if r <= self._newest]
            self._waiting = deque((w for w in self._waiting if w[2] > self._newest), _INBOX)
            self._inbox.extend(ready)

    def round_ended(self, round_: int, went_wrong: bool) -> None:
        """Publish this node's records of rounds up to ``round_``, or, when the round went
        wrong here (a sync failed, the node took the swarm's state), drop them: they were
        measured on a state the group may not share, and would cost this node as false."""
        for r in sorted(k for k in self._unpublished if k <= round_):
            for record in self._unpublished.pop(r):
                if went_wrong:
                    self._mine.pop((record.peer, record.round, record.fragment), None)
                    continue
                self.counts["made"] += 1
                self.publish(record.to_bytes())
                self._count(record)
        self._reached(round_)
        self._charged = {(p, r) for p, r in self._charged if r > round_ - _BASES_KEPT}

    def judge_inbox(self) -> None:
        """Judge every record received so far (called after each exchange and round)."""
        started = time.monotonic()
        self._judge_all()
        self.seconds += time.monotonic() - started

    def _judge_all(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                sender, data = self._inbox.popleft()
            self._judge(sender, data)

    # ---- measuring ----------------------------------------------------------------------

    def _check(self, peer: str, round_: int, fragment: int) -> CheckRecord | None:
        """This node's signed record of ``peer``'s contribution, or None when it could not
        fetch it (logged; counted against no one)."""
        base = self._bases[(round_, fragment)]
        fetched = self._fetch(peer, round_, fragment)
        if fetched is None:
            return None
        record = self._measure(peer, round_, fragment, base, fetched, self.me)
        return record.signed(self.identity)

    def _fetch(self, peer: str, round_: int, fragment: int) -> Fetched | None:
        s = self.settings
        numel = self.plan[fragment].numel
        request = msgpack.packb([round_, fragment])
        try:
            if peer == self.me:  # a record about this node's own contribution
                data = msgpack.packb(self.sent.get(round_, fragment) or [])
                return open_contribution(
                    data, peer, (round_, fragment), numel, self.wire, self.committed
                )
            data = self.transport.run(
                self.transport.call(
                    peer,
                    CONTRIBUTION_RPC,
                    request,
                    timeout=s.timeout,
                    max_response_bytes=self.wire.max_message_bytes * 2,
                ),
                s.timeout + 5,
            )
            self.counts["bytes_fetched"] += len(data)
            return open_contribution(
                data, peer, (round_, fragment), numel, self.wire, self.committed
            )
        except (ProtocolError, TimeoutError) as exc:
            self.counts["unserved"] += 1
            logger.warning(
                "round %d fragment %d: contribution of %s not checked: %s",
                round_,
                fragment,
                peer[:16],
                exc,
            )
            return None

    def _measure(
        self, peer: str, round_: int, fragment: int, base: _Base, fetched: Fetched, checker: str
    ) -> CheckRecord:
        """``checker``'s record: the losses before and after ``fetched`` on the batches the
        seed picks for it (unsigned)."""
        s = self.settings
        claimed = max(1, fetched.tokens // (s.batch_size * s.context))
        picked, val_picked = batch_plan(base.seed, peer, checker, claimed, s.batches, len(self.val))
        val = [self.val[i] for i in val_picked]
        before = self._params(base.vectors)
        moved = list(base.vectors)
        moved[fragment] = base.vectors[fragment] - fetched.vector.to(base.vectors[fragment])
        after = self._params(moved)
        assigned = None
        if s.assigned:
            stream = assigned_stream(self.train, s.batch_size, s.context, s.run_id, peer, round_)
            batches = stream.batches_at(picked)
            assigned = (self._loss(before, batches), self._loss(after, batches))
        return CheckRecord(
            checker=checker,
            peer=peer,
            run=s.run_id,
            round=round_,
            fragment=fragment,
            contribution=contribution_digest(fetched.digests),
            global_digest=base.digest,
            seed=base.seed.hex(),
            claimed=claimed,
            assigned=assigned,
            validation=(self._loss(before, val), self._loss(after, val)),
        )

    def _params(self, vectors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f, v in enumerate(vectors):
            out.update(self.plan.views(v, f))
        return out

    def _loss(self, params: dict[str, torch.Tensor], batches: Batches) -> float:
        """Mean cross-entropy in nats per token (:func:`node.trainer.mean_loss`)."""
        return mean_loss(self.model, batches, self.device, params)

    # ---- judging ------------------------------------------------------------------------

    def _judge(self, sender: str, data: bytes) -> None:
        try:
            record = open_record(data, self.settings.run_id)
        except RecordError as exc:
            self.counts["refused"] += 1
            logger.warning("check record from %s refused: %s", sender[:16], exc)
            return
        if record.checker != sender or record.round < self.settings.from_round:
            return
        if self.verifier.blocks(record.checker, record.round) is not None:
            return  # a quarantined or banned checker's word counts for nothing
        if record.round > self._newest:
            # a round this node has not reached: judged once it has (its own exchange
            # gives the base to judge it by) or the round ended here
            self._waiting.append((sender, data, record.round))
            return
        verdict = self._believe(record)
        if verdict is None:
            return
        if not verdict:
            self.counts["refused"] += 1
            self.verifier.standings.violation(
                record.checker,
                record.round,
                record.fragment,
                "bad_check_record",
                f"its record of {record.peer[:16]} does not reproduce",
            )
            self.events(
                "check_refused",
                checker=record.checker,
                peer=record.peer,
                round=record.round,
                fragment=record.fragment,
            )
            return
        self.counts["taken"] += 1
        self._count(record)

    def _believe(self, record: CheckRecord) -> bool | None:
        """True: count it; False: it is false (penalise its signer); None: this node cannot
        tell and the record fails, or is not this node's business."""
        base = self._bases.get((record.round, record.fragment))
        ok, _ = passes(record)
        if base is None or record.peer not in base.checkers:
            return True if ok else None  # another group's exchange, or one this node missed
        if (
            record.global_digest != base.digest
            or record.seed != base.seed.hex()
            or record.checker
            not in checkers_for(base.seed, record.peer, base.checkers, self.settings.checkers)
        ):
            return False
        mine = self._mine.get((record.peer, record.round, record.fragment))
        if mine is not None and mine.contribution != record.contribution:
            return False  # this node checked the same contribution: it was another one
        if ok and not self._audited(record):
            return True
        fetched = self._fetch(record.peer, record.round, record.fragment)
        if fetched is None:
            return True if ok else None
        self.counts["recomputed"] += 1
        theirs = self._measure(
            record.peer, record.round, record.fragment, base, fetched, record.checker
        )
        return reproduces(record, theirs)

    def _audited(self, record: CheckRecord) -> bool:
        """Whether this node recomputes a passing record (a fixed share, by hash)."""
        h = hashlib.sha256(f"{self.me}/{record.key}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < self.settings.audit

    def _count(self, record: CheckRecord) -> None:
        ok, why = self.scores.add(record)
        score = self.scores.score(record.peer)
        self.events(
            "check",
            checker=record.checker,
            peer=record.peer,
            round=record.round,
            fragment=record.fragment,
            passed=ok,
            gains=list(record.gains),
            flagged=score["flagged"],
        )
        if score["flagged"] and (record.peer, record.round) not in self._charged:
            self._charged.add((record.peer, record.round))
            self.verifier.standings.violation(
                record.peer,
                record.round,
                record.fragment,
                "useless_work",
                f"{score['passed']} of {score['records']} checks passed: {score['last_failure']}",
            )

    def summary(self) -> dict[str, Any]:
        """Counts, time spent and the peers flagged, for the round event."""
        return {
            **self.counts,
            "seconds": round(self.seconds, 3),
            "flagged": sorted(self.scores.flagged()),
        }
