"""What a useful-work check needs, collected on the training thread as exchanges are
applied and handed to the checks' worker whole, once per round.

Each applied exchange leaves an :class:`ExchangeBase`: the fragment's value the group
held before the outer step (its mean copy where it mixed, else the global copy every
member announced alike), its reduced pseudo-gradient and its contributors. A round whose
every fragment was exchanged this way, and which ended well on this node, becomes a
:class:`RoundInputs`: the round's base, the same on every member of the node's group
(groups are formed per round, so one group shares every fragment).

Fragments sync one after another through a round, so a contribution to fragment ``f``
was trained beside fragments that had already taken the round's step and fragments
that had not. :meth:`RoundInputs.vectors` gives that state, from shared values only:
fragments before ``f`` at their base stepped by the group's reduced pseudo-gradient
(times the step's scale, the outer learning rate of the round and, for Nesterov, one
plus its momentum: the step without the momentum buffer each member keeps for itself),
fragments from ``f`` on at their base.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field

import torch

from verification.usefulness import (
    assignment_seed,
    checkers_for,
    fragment_digest,
    fragments_checked,
    round_base_digest,
)

__all__ = ["CheckSettings", "ExchangeBase", "RoundBook", "RoundInputs"]

logger = logging.getLogger(__name__)

_ROUNDS_OPEN = 4
"""Rounds whose exchanges are collected at once (older incomplete ones are dropped)."""


@dataclass(frozen=True)
class CheckSettings:
    """The ``trust.check*`` keys and the shapes a check needs (:func:`node.settings.check_settings`).

    Attributes:
        run_id: the run.
        checkers: checkers drawn per contribution (``trust.checkers``).
        windows: claimed and control windows per check (``trust.check_windows``).
        fragments: fragments of each contributor checked per round
            (``trust.check_fragments``).
        from_round: the first round with check records (replay and sent checks run
            from round 1).
        audit: the share of other checkers' records this node recomputes.
        assigned: measure claimed batches (else control batches of validation text only).
        context: tokens per window.
        timeout: deadline of one fetch (seconds).
        budget: the largest share of wall time the checks' worker may be busy.
        records_charge: a peer its check records flag is charged with ``useless_work``
            (else records only weigh contributions, and a charge needs a failed replay
            or sent check: where both run, :func:`node.settings.check_settings`).
    """

    run_id: str
    checkers: int
    windows: int
    fragments: int
    from_round: int
    audit: float
    assigned: bool
    context: int
    timeout: float
    budget: float
    records_charge: bool = True


@dataclass
class ExchangeBase:
    """One applied exchange, as the checks see it.

    Attributes:
        round: the exchange's round; ``fragment``: its fragment.
        base: the fragment's value the group held before the outer step (never written
            after: a copy, or the group's mean copy as it came back).
        update: the exchange's reduced pseudo-gradient (never written after).
        contributors: the peers whose parts it reduced, sorted.
        step: the scale of the step without momentum (see the module docstring).
        mixed: the group averaged its members' copies: each contribution was computed
            against its member's own copy, which a check fetches.
        result: the digest of ``update`` (set by :meth:`RoundInputs.prepare`).
        group: the exchange's members, sorted.
    """

    round: int
    fragment: int
    base: torch.Tensor
    update: torch.Tensor
    contributors: tuple[str, ...]
    step: float = 0.0
    mixed: bool = False
    result: str = ""
    group: tuple[str, ...] = ()


@dataclass
class RoundInputs:
    """A round every fragment of which this node exchanged and applied, and which ended
    well here: the base every check of the round measures on. Its digests are taken on
    the checks' worker (:meth:`prepare`), never on the training thread."""

    round: int
    exchanges: list[ExchangeBase]
    digests: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def prepare(self) -> RoundInputs:
        """Take every digest (once)."""
        with self._lock:
            if not self.digests:
                for e in self.exchanges:
                    e.result = fragment_digest(e.update)
                self.digests = [fragment_digest(e.base) for e in self.exchanges]
        return self

    @functools.cached_property
    def base(self) -> str:
        """The round's base digest (:func:`verification.usefulness.round_base_digest`)."""
        return round_base_digest(self.prepare().digests)

    def seed(self, run_id: str, fragment: int) -> bytes:
        e = self.prepare().exchanges[fragment]
        return assignment_seed(run_id, self.round, fragment, self.base, e.result, e.contributors)

    def checkers(self, settings: CheckSettings, fragment: int, peer: str) -> list[str]:
        """The checkers the seed draws for ``peer``'s contribution to exchange
        ``fragment``, the first of them the one that replays it; none where that
        fragment of ``peer`` is not checked this round. Every member of the group draws
        the same: checkers to know what to check and judge, the member to know which
        start states to keep."""
        drawn = fragments_checked(
            self.base, self.round, peer, len(self.exchanges), settings.fragments
        )
        if fragment not in drawn:
            return []
        contributors = self.exchanges[fragment].contributors
        seed = self.seed(settings.run_id, fragment)
        return checkers_for(seed, peer, contributors, settings.checkers)

    def vectors(self, fragment: int) -> list[torch.Tensor]:
        """Every fragment's values when ``fragment`` synced (see the module docstring)."""
        return [
            e.base - e.step * e.update.to(e.base) if e.fragment < fragment else e.base
            for e in self.exchanges
        ]


class RoundBook:
    """Collects each round's applied exchanges (training thread) until the round ends.

    Args:
        fragments: fragments in the model.
    """

    def __init__(self, fragments: int) -> None:
        self.fragments = fragments
        self._open: dict[int, dict[int, ExchangeBase]] = {}
        self._lock = threading.Lock()
        self.regrouped = 0
        """Rounds not checked because their fragments were exchanged in other groups."""

    def applied(self, exchange: ExchangeBase) -> None:
        """An exchange was applied, and every part of it came back reduced."""
        with self._lock:
            self._open.setdefault(exchange.round, {})[exchange.fragment] = exchange
            for old in sorted(self._open)[:-_ROUNDS_OPEN]:
                del self._open[old]

    def close(self, round_: int) -> RoundInputs | None:
        """Round ``round_`` ended well: its inputs when every fragment is in and every
        fragment was exchanged in the one group, else None.

        The round's base, a check's seed and the state a contribution is measured on
        are taken from every fragment's exchange; a member shares them with its group
        only where the group exchanged every fragment. A peer that drops out of view, or
        comes back, between two fragments' syncs regroups the rest of the round: the
        members of a later fragment's group then hold other exchanges of the earlier
        fragments, draw other seeds, and a member would keep other start states than
        its checkers replay. Such a round is not checked, on every member alike (each
        sees its own groups differ)."""
        with self._lock:
            found = self._open.pop(round_, {})
            for old in [r for r in self._open if r < round_]:
                del self._open[old]
        if sorted(found) != list(range(self.fragments)):
            return None
        if len({e.group for e in found.values()}) > 1:
            self.regrouped += 1
            logger.info(
                "round %d: its fragments were exchanged in other groups; not checked", round_
            )
            return None
        return RoundInputs(round_, [found[f] for f in range(self.fragments)])

    def drop(self, round_: int) -> None:
        """Round ``round_`` went wrong here: nothing of it is checked."""
        with self._lock:
            self._open.pop(round_, None)
