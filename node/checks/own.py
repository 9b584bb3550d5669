"""The checks this node was drawn to make, as the checks' worker runs them
(:mod:`node.checks.work`): a round's draw (:mod:`verification.usefulness`), the node's
own trace told which of its windows its checkers replay, each drawn contribution
fetched and sent-checked at once (:meth:`node.checks.replays.ReplayChecks.check`), and,
once the budget allows, measured (:mod:`node.checks.measure`) into a signed record that
is gossiped and counted (:mod:`node.checks.records`)."""

from __future__ import annotations

import logging

from node.checks.inputs import CheckSettings, RoundInputs
from node.checks.measure import Checked
from node.checks.parts import CheckHooks, CheckParts
from node.checks.records import Records
from node.checks.replays import Pending, ReplayChecks
from protocol.errors import ProtocolError
from verification.usefulness import CheckRecord

__all__ = ["Costly", "Drawn", "OwnChecks"]

logger = logging.getLogger(__name__)

Drawn = tuple[RoundInputs, int, str]
"""A drawn check: a round's inputs, a fragment and the peer whose contribution it checks."""
Costly = tuple[RoundInputs, int, str, Pending | None]
"""A drawn check's costly part, left for the budget: the replay to make (None: none),
then the record."""


class OwnChecks:
    """This node's own checks (see the module docstring).

    Args:
        settings: the check settings.
        parts: the checks' collaborators.
        hooks: where a record is gossiped.
        records: where records and failures are counted.
        replays: the replay and sent checks.
    """

    def __init__(
        self,
        settings: CheckSettings,
        parts: CheckParts,
        hooks: CheckHooks,
        records: Records,
        replays: ReplayChecks,
    ) -> None:
        self.settings = settings
        self.identity = parts.identity
        self.me = parts.identity.peer_id
        self.measurer = parts.measurer
        self.fetcher = parts.fetcher
        self.tracer = parts.tracer
        self.publish = hooks.publish
        self.records = records
        self.counts = records.counts
        self.replays = replays

    def release(self, inputs: RoundInputs) -> None:
        """Tell this node's trace who replays its contribution to each exchange of round
        ``inputs.round``, as its checkers draw it (the same inputs on every member of
        its group): the trace keeps only those windows' start states."""
        assert self.tracer is not None
        s = self.settings
        for f, exchange in enumerate(inputs.exchanges):
            mine = self.me in exchange.contributors
            drawn = inputs.checkers(s, f, self.me) if mine else []
            seed = inputs.seed(s.run_id, f)
            self.tracer.drawn(inputs.round, f, seed, drawn[0] if drawn else None)

    def draw(self, inputs: RoundInputs, forget_before: int) -> list[Drawn]:
        """Every check of round ``inputs.round`` this node was drawn to; contributions
        fetched for rounds before ``forget_before`` are no longer cached."""
        drawn_checks = []
        for f, exchange in enumerate(inputs.exchanges):
            if self.me not in exchange.contributors:
                continue  # a member left out of the exchange checks no one in it
            for peer in exchange.contributors:
                if peer != self.me and self.me in inputs.checkers(self.settings, f, peer):
                    drawn_checks.append((inputs, f, peer))
        self.fetcher.forget(forget_before)
        return drawn_checks

    def sent(self, inputs: RoundInputs, fragment: int, peer: str) -> Costly | None:
        """A drawn check's cheap part, made at once: the contribution fetched and its
        sent check. The costly part it leaves (None: none: not served, or no replay to
        make before the records' warm-up is over)."""
        try:
            pending = self.replays.check(inputs, fragment, peer)
        except (ProtocolError, TimeoutError) as exc:  # not served: against no one
            self.counts["unserved"] += 1
            logger.info(
                "round %d fragment %d: contribution of %s not checked: %s",
                *(inputs.round, fragment, peer[:16], exc),
            )
            return None
        if pending is None and inputs.round < self.settings.from_round:
            return None
        return inputs, fragment, peer, pending

    def record(self, inputs: RoundInputs, fragment: int, peer: str) -> None:
        """Measure ``peer``'s contribution to exchange ``(inputs.round, fragment)``, sign
        the record, gossip it and count it."""
        record = self.measure(inputs, fragment, peer, self.me)
        if record is None:
            return
        record = record.signed(self.identity)
        self.counts["made"] += 1
        self.publish(record.to_bytes())
        self.records.count(record)

    def measure(
        self, inputs: RoundInputs, fragment: int, peer: str, checker: str
    ) -> CheckRecord | None:
        """``checker``'s record of ``peer`` in exchange ``(inputs.round, fragment)``, as
        this node measures it; None when a contribution could not be had (logged,
        counted against no one)."""
        mixed = inputs.exchanges[fragment].mixed
        get = self.fetcher.get
        try:
            checked, reference = (
                Checked(
                    get(who, inputs.round, fragment),
                    get(who, inputs.round, fragment, "weights") if mixed else None,
                )
                for who in (peer, checker)
            )
        except (ProtocolError, TimeoutError) as exc:
            self.counts["unserved"] += 1
            logger.warning(
                "round %d fragment %d: contribution of %s not checked: %s",
                *(inputs.round, fragment, peer[:16], exc),
            )
            return None
        return self.measurer.record(inputs, fragment, peer, checker, checked, reference)
