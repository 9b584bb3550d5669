"""Replaying a window of a member's training (:mod:`verification.replay`).

:class:`Replayer` keeps a copy of the model and an inner optimizer of its own (the
training thread never sees them). A replay check of a contribution takes its member's
signed trace (whose digest the contribution's claim carries), checks that its windows
tile the claimed batches and are no longer than ``trust.replay_steps``, draws one window
from the exchange's seed, fetches that window's start state (it must hash to the
recorded digest), loads it and trains the window's steps again on the claimed batches
(:func:`node.train.trainer.replay_step`, each rank's batches for a site) at the learning rate
of the recorded step count, then compares the change and the losses with the recorded
ones (:func:`verification.replay.agreement`).

Every checker drawn for the contribution (not only the first, which replays) makes the
sent check on the same opened trace (:meth:`Replayer.sent_check`,
:mod:`verification.binding`): the contribution's sketch against the sum of its trace's
windows.

The same replay confirms or refutes another checker's failed record: anyone holding the
run's tokens can run it, in the member's group or not.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from node.config import TrainConfig
from node.data.corpus import DataError, assigned_stream, site_slice
from node.train.trainer import lr_at, make_inner_optimizer, replay_step
from node.train.trainstate import StateError, load_state, state_digest
from protocol.averaging.contributions import WorkClaim
from protocol.averaging.fragments import FragmentPlan
from verification import binding
from verification.replay import ReplayRecord, agreement, drawn_window
from verification.sketch import Sketcher
from verification.traces import ReplayError, Trace, TraceWindow, covers, open_trace

__all__ = ["Fetch", "NotKept", "ReplaySettings", "Replayer", "Unavailable"]

logger = logging.getLogger(__name__)

Fetch = Callable[[str, list], bytes]
"""``(peer, request)`` to its :data:`node.checks.trace.REPLAY_RPC` answer (empty: not kept).
Raises :class:`Unavailable` when the peer cannot be asked."""


class Unavailable(Exception):
    """The member could not be asked (a timeout, a closed stream): nothing is known."""


class NotKept(Unavailable):
    """The member answered that it keeps none of what was asked (a restart lost it, or
    its draw of the windows to keep differs from the checker's)."""


@dataclass(frozen=True)
class ReplaySettings:
    """``trust.replay_*`` and what a replay needs of the run.

    Attributes:
        run_id: the run.
        steps: the longest window a trace may hold (``trust.replay_steps``).
        tolerance: the largest distance and loss difference a replay may show
            (``trust.replay_tolerance``).
        context: tokens per window of text.
        train: the run's inner-loop settings (the optimizer, precision, clipping, the
            learning-rate schedule), which a replay trains with.
        codec: the sync's codec, its ``block_size``, ``stochastic`` rounding and error
            ``feedback`` (how far a sent vector may be from its work:
            :func:`verification.binding.slack`).
        spans: the most spans a claim holds (:data:`node.checks.claims.MAX_SPANS`; a claim
            that holds them may have lost its oldest work: no sent check).
    """

    run_id: str
    steps: int
    tolerance: float
    context: int
    train: TrainConfig
    codec: str = "none"
    block_size: int = 256
    stochastic: bool = False
    feedback: bool = False
    spans: int = 32


class Replayer:
    """Replays windows of members' training.

    Args:
        settings: the replay settings.
        model: the node's model (copied once; its values are never read).
        train: the run's train tokens (every slice of them).
        device: where to train.
        fetch: asks a member for a trace or a state.
        plan: the model's fragments (None: no sent check).
    """

    def __init__(
        self,
        settings: ReplaySettings,
        model: nn.Module,
        train: torch.Tensor,
        device: torch.device,
        fetch: Fetch,
        plan: FragmentPlan | None = None,
    ) -> None:
        self.settings = settings
        self.model = copy.deepcopy(getattr(model, "module", model)).to(device).train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.cfg = settings.train
        self.optimizer = make_inner_optimizer(self.model, settings.train)
        self.train = train
        self.device = device
        self.fetch = fetch
        self.sketcher = Sketcher(settings.run_id)
        self.plan = plan
        self._index = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        self.steps = 0
        """Steps replayed so far."""
        self.seconds = 0.0
        """Time spent replaying them."""
        self.bytes_fetched = 0

    # ---- a check ----------------------------------------------------------------------

    def check(
        self, checker: str, peer: str, key: tuple[int, int], claim: WorkClaim, seed: bytes
    ) -> ReplayRecord | None:
        """``checker``'s unsigned replay record of ``peer``'s contribution to exchange
        ``key``, trained on ``claim``; None when the member could not be asked or did
        not serve its trace or the window's start state (a node that restarted holds
        neither: not served counts against no one, as a contribution not served)."""
        try:
            opened = self.opened(checker, peer, key, claim)
            if not isinstance(opened, tuple):
                return opened
            return self.drawn(checker, *opened, seed)
        except Unavailable:
            return None

    def opened(
        self, checker: str, peer: str, key: tuple[int, int], claim: WorkClaim
    ) -> tuple[Trace, bytes] | ReplayRecord:
        """``peer``'s trace of its contribution to exchange ``key`` and its bytes, once
        fetched and found to be the one ``claim`` names and consistent; else
        ``checker``'s failed record (false on its face).

        Raises:
            Unavailable: the member could not be asked (:class:`NotKept`: it keeps no
                such trace).
        """
        round_, fragment = key

        def failed(why: str, trace: bytes = b"") -> ReplayRecord:
            return ReplayRecord(checker, peer, round_, fragment, trace, 0, False, why=why)

        if claim.trace is None:
            return failed("its claim carries no trace")
        data = self._ask(peer, ["trace", round_, fragment])
        try:
            trace = open_trace(data, self.settings.run_id, peer)
        except ReplayError as exc:
            return failed(f"its trace is refused: {exc}")
        if trace.digest != claim.trace or (trace.round, trace.fragment) != key:
            return failed("its trace is not the one its claim names")
        if trace.spans != claim.spans or trace.shape != _shape(claim):
            return failed("its trace names other batches than its claim")
        why = self.inconsistent(trace)
        if why:
            return failed(why, data)  # false on its face: anyone can see it
        return trace, data

    def drawn(self, checker: str, trace: Trace, data: bytes, seed: bytes) -> ReplayRecord:
        """``checker``'s record of replaying the window of an opened ``trace`` the seed
        draws for it.

        Raises:
            Unavailable: the member did not serve the window's start state.
        """
        index = drawn_window(seed, checker, len(trace.windows))
        state = self._ask(trace.peer, ["state", trace.windows[index].state])
        if state_digest(state) != trace.windows[index].state:
            why = "its start state is not the one its trace names"
            record = ReplayRecord(
                checker, trace.peer, trace.round, trace.fragment, data, index, False, why=why
            )
            return dataclasses.replace(record, state=False)
        return self.judge(checker, trace, data, index, state)

    def inconsistent(self, trace: Trace) -> str:
        """What makes ``trace`` false on its face ("" when nothing does): windows that do
        not tile the batches it names, or longer than ``trust.replay_steps``."""
        if not trace.windows:
            return "its trace holds no window"
        if not covers(trace.windows, trace.spans):
            return "its windows do not tile the batches it claims"
        longest = max(w.steps for w in trace.windows)
        if longest > self.settings.steps:
            return (
                f"a window of {longest} steps, longer than trust.replay_steps = "
                f"{self.settings.steps}"
            )
        return ""

    def judge(
        self, checker: str, trace: Trace, data: bytes, index: int, state: bytes
    ) -> ReplayRecord:
        """The record of replaying window ``index`` of ``trace`` from ``state``."""
        window = trace.windows[index]
        try:
            change, losses = self.replay(trace, window, state)
        except (StateError, DataError) as exc:
            distance, loss, passed = 0.0, 0.0, False
            why = f"its window does not replay: {exc}"
        else:
            distance, loss = agreement(window, change, losses)
            passed = distance <= self.settings.tolerance and loss <= self.settings.tolerance
            why = f"replayed {distance:.3g} of its change apart, losses {loss:.3g} apart"
        return ReplayRecord(
            checker,
            trace.peer,
            trace.round,
            trace.fragment,
            data,
            index,
            passed,
            distance=distance,
            loss=loss,
            why="" if passed else why,
        )

    def sent_check(
        self, checker: str, trace: Trace, data: bytes, sent: torch.Tensor
    ) -> ReplayRecord | None:
        """The record of the sent check of ``trace``'s contribution, whose values are
        ``sent`` (:mod:`verification.binding`); None where it does not apply: sparse
        codecs, a claim at the most spans, a trace without fragment sketches."""
        s, moved = self.settings, binding.trace_sum(trace.windows)
        allowed = binding.slack(sent, s.codec, s.block_size, s.stochastic, s.feedback)
        if self.plan is None or moved is None or allowed is None or len(trace.spans) >= s.spans:
            return None
        views = self.plan.views(sent.detach().float().cpu(), trace.fragment)
        sketch = self.sketcher.pieces((self._index[n], v) for n, v in views.items())
        distance = binding.sent_apart(moved, sketch)
        passed = binding.passes(moved, sketch, s.tolerance, allowed)
        why = f"what it sent is {distance:.3g} of its trace's change apart from it"
        record = ReplayRecord(checker, trace.peer, trace.round, trace.fragment, data, 0, passed)
        return dataclasses.replace(record, distance=distance, why="" if passed else why, sent=True)

    def confirm(self, record: ReplayRecord, me: str) -> ReplayRecord | None:
        """``me``'s own replay of another checker's failed ``record`` (which must hold its
        evidence, :attr:`~verification.replay.ReplayRecord.proof`, and a consistent
        trace: :meth:`inconsistent`); None when the start state could not be had."""
        trace = record.opened
        assert trace is not None
        window = trace.windows[record.window]
        try:
            state = self._ask(record.peer, ["state", window.state])
        except Unavailable:
            return None
        if state_digest(state) != window.state:
            return None
        return self.judge(me, trace, record.trace, record.window, state)

    # ---- the replay -------------------------------------------------------------------

    def replay(
        self, trace: Trace, window: TraceWindow, state: bytes
    ) -> tuple[list[float], list[float]]:
        """Train ``window`` again from ``state``: the sketch of the change and each
        step's loss (rank 0's).

        Raises:
            StateError: the state does not fit this model and optimizer.
            DataError: the window names data this node cannot draw.
        """
        started = time.perf_counter()
        try:
            params = list(self.model.parameters())
            load_state(state, params, self.optimizer)
            begin = self.sketcher.sketch(params)
            batches = self._batches(trace, window)
            losses = []
            for i in range(window.steps):
                micro = [rank[i * window.accum : (i + 1) * window.accum] for rank in batches]
                lr = lr_at(window.step + i, self.cfg)
                losses.append(
                    replay_step(self.model, self.optimizer, self.cfg, micro, lr, self.device)
                )
            change = (self.sketcher.sketch(params) - begin).tolist()
        finally:
            self.seconds += time.perf_counter() - started
        self.steps += window.steps
        return change, losses

    def _batches(
        self, trace: Trace, window: TraceWindow
    ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each rank's batches of ``window``, in order."""
        ranks, index, count, batch = trace.shape
        context, run = self.settings.context, self.settings.run_id
        out = []
        for rank in range(ranks):
            data = site_slice(self.train, index * ranks + rank, count * ranks, context)
            stream = assigned_stream(data, batch, context, run, trace.peer, window.stream, rank)
            out.append(stream.batches_at(range(window.start, window.start + window.draws)))
        return out

    def _ask(self, peer: str, request: list) -> bytes:
        """``peer``'s answer to ``request``.

        Raises:
            Unavailable: no answer; :class:`NotKept`: it keeps none.
        """
        data = self.fetch(peer, request)
        if not data:
            what = "its trace" if request[0] == "trace" else "the window's start state"
            raise NotKept(f"it no longer keeps {what}")
        self.bytes_fetched += len(data)
        return data


def _shape(claim: WorkClaim) -> tuple[int, int, int, int]:
    return claim.ranks, claim.slice[0], claim.slice[1], claim.batch
