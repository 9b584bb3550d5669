"""Measuring a contribution: the losses a check record holds.

:class:`Measurer` keeps its own copy of the model's modules (the training thread never
sees it) and evaluates any parameter values through it: the round's base, and the base
with one contribution applied to one fragment. For a contribution ``P`` checked by
``checker`` on exchange ``(r, f)`` it measures

- each window's loss before and after ``P``, on windows of ``P``'s claimed batches
  that the seed draws for ``checker`` (:func:`verification.usefulness.window_plan`);
- the same of the checker's own contribution (the reference), on windows of the
  checker's own claimed batches;
- on the exchange's control windows (the same for every checker: a stream keyed by the
  seed over the run's train tokens, or over its validation tokens when the run checks
  validation only), before and after ``P``, and before and after the reference.

*Before* a contribution is the round's base (:meth:`RoundInputs.vectors`), except that
where the group mixed copies the exchange's fragment holds the copy its member sent
(fetched as its signed, committed parts): a pseudo-gradient is how far its member trained
from its own copy, and copies in a mixing swarm sit apart (on the test workload 10 to
30 % in a run's first rounds, while members that do no work drag the groups' means
back), so applied to the group's mean an honest one can look harmful. *After* is before
with the pseudo-gradient subtracted from that fragment.

Every loss is :func:`node.train.trainer.window_losses`: one fp32 forward of the windows in
eval mode, each window's sum in float64, so two nodes agree to about 1e-6 relative.
Losses at the same values on the same windows are computed once (those at the base and
with the reference, by all of a checker's records of an exchange).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from node.checks.inputs import CheckSettings, RoundInputs
from node.data.corpus import BatchStream, DataError, assigned_stream, site_slice
from node.train.trainer import window_losses
from protocol.averaging.contributions import Fetched, WorkClaim
from protocol.averaging.fragments import FragmentPlan
from verification.usefulness import CheckRecord, contribution_digest, control_key, window_plan

__all__ = ["Checked", "Measurer", "claimed_batches"]

Windows = tuple[torch.Tensor, torch.Tensor]
State = tuple[tuple, dict[str, torch.Tensor]]
"""Parameter values by name, with a key that names them (for the cache)."""
_CACHED = 32
"""Losses kept for reuse (a base's, a reference's), by values and windows."""


@dataclass(frozen=True)
class Checked:
    """A member's contribution to an exchange: its pseudo-gradient and, where the group
    mixed copies, the copy it sent (which the pseudo-gradient was computed against)."""

    update: Fetched
    own: Fetched | None = None

    @property
    def digest(self) -> str:
        copy = self.own.digests if self.own is not None else []
        return contribution_digest([*self.update.digests, *copy])

    @property
    def claim(self) -> WorkClaim | None:
        return self.update.claim


def claimed_batches(claim: WorkClaim, indices: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(rank, round, draw)`` of each index into ``claim``'s batches (ranks outermost,
    then the spans in order)."""
    per_rank = sum(count for _, _, count in claim.spans)
    for index in indices:
        rank, k = divmod(index, per_rank)
        for round_, start, count in claim.spans:
            if k < count:
                yield rank, round_, start + k
                break
            k -= count


class Measurer:
    """Losses of contributions on a round's base.

    Args:
        settings: the check settings.
        model: the node's model (copied once; its values are never read).
        plan: the fragment plan.
        train: the run's train tokens (every slice of them).
        val: the run's validation tokens.
        device: where to evaluate.
    """

    def __init__(
        self,
        settings: CheckSettings,
        model: nn.Module,
        plan: FragmentPlan,
        train: torch.Tensor,
        val: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.settings = settings
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.plan = plan
        self.train = train
        self.val = val
        self.device = device
        self.forwards = 0
        """Windows evaluated so far."""
        self.seconds = 0.0
        """Time spent evaluating them."""
        self._cache: OrderedDict[tuple, list[float]] = OrderedDict()

    def record(
        self,
        inputs: RoundInputs,
        fragment: int,
        peer: str,
        checker: str,
        checked: Checked,
        reference: Checked,
    ) -> CheckRecord:
        """``checker``'s unsigned record of ``checked`` (``peer``'s contribution), with
        ``reference`` (``checker``'s own) as the measure of honest work."""
        s = self.settings
        seed = inputs.seed(s.run_id, fragment)
        before, after, ref_before, ref_after = self._states(inputs, fragment, checked, reference)
        key = ("control", seed.hex())
        control = self._rows(
            [before, after, ref_before, ref_after], key, self._control_windows(seed)
        )
        claimed = checked.claim.batches if checked.claim is not None else 0
        assigned: list[tuple[float, ...]] = []
        reference_assigned: list[tuple[float, ...]] = []
        if s.assigned:
            windows = self._claimed(checked.claim, seed, peer, checker)
            if windows is None:
                claimed = 0  # names data no one can draw: it claims nothing checkable
            else:
                key = ("assigned", seed.hex(), peer, checker)
                assigned = self._rows([before, after], key, windows)
            own = self._claimed(reference.claim, seed, checker, checker)
            if own is not None:
                key = ("assigned", seed.hex(), checker, checker)
                reference_assigned = self._rows([ref_before, ref_after], key, own)
        return CheckRecord(
            checker=checker,
            peer=peer,
            run=s.run_id,
            round=inputs.round,
            fragment=fragment,
            contribution=checked.digest,
            reference=reference.digest,
            base=inputs.base,
            result=inputs.exchanges[fragment].result,
            seed=seed.hex(),
            claimed=claimed,
            reference_claimed=reference.claim.batches if reference.claim is not None else 0,
            assigned=tuple(assigned),  # type: ignore[arg-type]
            reference_assigned=tuple(reference_assigned),  # type: ignore[arg-type]
            control=tuple(control),  # type: ignore[arg-type]
        )

    # ---- windows ------------------------------------------------------------------------

    def _control_windows(self, seed: bytes) -> Windows:
        s = self.settings
        data = self.train if s.assigned else self.val
        # twice as many as claimed windows: every record's work ratio rests on them
        return BatchStream(data, 2 * s.windows, s.context, control_key(seed)).next()

    def _claimed(
        self, claim: WorkClaim | None, seed: bytes, peer: str, checker: str
    ) -> Windows | None:
        """The windows of ``peer``'s ``claim`` the seed draws for ``checker``; None when
        there is no claim, or it names data this node cannot draw from (a slice too
        short)."""
        if claim is None:
            return None
        s = self.settings
        plan = window_plan(seed, peer, checker, claim.batches, claim.batch, s.windows)
        inputs, targets = [], []
        index, count = claim.slice
        try:
            for (rank, round_, draw), (_, window) in zip(
                claimed_batches(claim, [b for b, _ in plan]), plan, strict=True
            ):
                data = site_slice(
                    self.train, index * claim.ranks + rank, count * claim.ranks, s.context
                )
                stream = assigned_stream(data, claim.batch, s.context, s.run_id, peer, round_, rank)
                ((x, y),) = stream.batches_at([draw])
                inputs.append(x[window])
                targets.append(y[window])
        except DataError:
            return None
        if not inputs:
            return None
        return torch.stack(inputs), torch.stack(targets)

    # ---- losses -------------------------------------------------------------------------

    def _states(
        self, inputs: RoundInputs, fragment: int, checked: Checked, reference: Checked
    ) -> list[State]:
        """Before and after ``checked``, before and after ``reference`` (see the module
        docstring), each with a key that names its values."""
        vectors = inputs.vectors(fragment)
        name = (inputs.round, fragment, inputs.base)
        out = []
        for c in (checked, reference):
            start = vectors[fragment] if c.own is None else c.own.vector.to(vectors[fragment])
            before: dict[str, torch.Tensor] = {}
            for f, vector in enumerate(vectors):
                before.update(self.plan.views(start if f == fragment else vector, f))
            after = dict(before)
            # a pseudo-gradient is ``global - local``: it is subtracted
            after.update(self.plan.views(start - c.update.vector.to(start), fragment))
            own = "base" if c.own is None else contribution_digest(c.own.digests)
            out += [(("before", *name, own), before), (("after", *name, c.digest), after)]
        return out

    def _rows(self, states: list[State], key: tuple, windows: Windows) -> list[tuple[float, ...]]:
        """Each window's losses in every state, as rows."""
        return list(zip(*(self._losses(st, key, windows) for st in states), strict=True))

    def _losses(self, state: State, key: tuple, windows: Windows) -> list[float]:
        """``windows``' losses at ``state`` (computed once per state and windows)."""
        name, params = state
        full = (*name, *key)
        if full in self._cache:
            self._cache.move_to_end(full)
            return self._cache[full]
        started = time.perf_counter()
        losses = window_losses(self.model, *windows, params, self.device)
        self.forwards += len(losses)
        self.seconds += time.perf_counter() - started
        self._cache[full] = losses
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return losses
