"""The node's trace of its own training, kept so that checkers can replay it.

With ``trust.replay_steps = w`` the training loop tells :class:`Tracer` about every
inner step. The tracer cuts the steps into windows of at most ``w``: a window starts
with a snapshot of the trained model's parameters and inner optimizer state
(:class:`node.train.trainstate.Snapshot`, kept in memory under its digest) and ends after
``w`` steps, or earlier where the loop is about to change the model otherwise
(:meth:`Tracer.seal`: a sync applied, a catch-up), the stream changed, or a sync takes
its claim. A window records each fragment's sketch of its change (end minus start).
Values probed after each step guard the windows: a model changed unannounced since a
window's last step drops that window rather than record a wrong change. When a sync
takes its claim (:meth:`Tracer.claim`), the windows of the claimed batches become a
signed :class:`~verification.traces.Trace` whose digest goes into the claim, and so
into every part and the commitment. The tracer serves traces and start states on
:data:`REPLAY_RPC` for :data:`~protocol.averaging.contributions.ROUNDS_KEPT` rounds.

What it costs the training thread: a sketch a window (one pass over the parameters:
the last window's end is the next one's start), a few probed values after each step,
and one copied state per window, 12 bytes a parameter with AdamW. The trace's own thread
hashes each state with BLAKE3 beside the next steps and writes the states beyond
:data:`MEMORY_BYTES` to files of the node's ``trace/`` folder (:mod:`node.checks.states`).
Both threads' time counts in :meth:`Tracer.spent`. A state is kept while a claim may
still name it, and once the round's seed is known (:meth:`Tracer.drawn`, from the
checks' worker) only the states of the windows the seed draws for replay are kept
(docs/trust.md, "Replay checks").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import torch
from torch import nn

from node.checks.states import StateStore, unlink
from node.train.trainstate import Snapshot, TimedExecutor
from protocol.averaging.contributions import ROUNDS_KEPT, WorkClaim
from protocol.averaging.fragments import FragmentPlan
from protocol.errors import ProtocolError
from verification.identity import Identity
from verification.replay import drawn_window
from verification.sketch import Sketcher
from verification.traces import Trace, TraceWindow

__all__ = ["REPLAY_RPC", "TraceSettings", "Tracer"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

REPLAY_RPC = "atoll.replay"
"""``msgpack(["trace", round, fragment])`` for a signed trace, ``msgpack(["state",
digest])`` for a window's packed start state; an empty answer when it is not kept."""
_PROBES = 16
"""Values of each probed parameter tensor read before and after every step."""
_PROBED = 8
"""Parameter tensors of each fragment probed."""
MEMORY_BYTES = 2 << 30
"""Bytes of start states a node keeps in memory; beyond them, in files."""


@dataclass(frozen=True)
class TraceSettings:
    """How the node traces its training.

    Attributes:
        run_id: the run (the sketches' seed).
        steps: the longest window (``trust.replay_steps``).
        accum: draws per step (``train.grad_accum``).
        spill: a folder for start states beyond ``memory`` bytes (None: all in memory).
        memory: bytes of start states kept in memory before they go to ``spill``
            (``trust.replay_memory_mb``).
    """

    run_id: str
    steps: int
    accum: int
    spill: Path | None = None
    memory: int = MEMORY_BYTES


@dataclass
class _Open:
    """The window being recorded."""

    stream: int
    start: int
    step: int
    accum: int
    snapshot: Snapshot
    begin: torch.Tensor
    """Each fragment's sketch at the window's start."""
    losses: list[float] = field(default_factory=list)
    probed: torch.Tensor | None = None
    """The probe (:meth:`Tracer._probe`) after the last step."""


@dataclass
class _Kept:
    """A signed trace served for a claim, and the start states it still needs: every
    window's until the round's seed is known, then the drawn windows' (``drawn``)."""

    data: bytes
    states: tuple[str, ...]
    drawn: bool = False


def _timed(method: Callable[..., _R]) -> Callable[..., _R]:
    """Count a training-thread method's time in :meth:`Tracer.spent`."""

    @functools.wraps(method)
    def timed(self: Tracer, *args: Any, **kwargs: Any) -> _R:
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - began

    return timed


class Tracer:
    """This node's trace (see the module docstring).

    Args:
        settings: the windows' length, and where start states are kept.
        identity: signs traces.
        plan: the model's fragments (None: one): a fragment's trace records that
            fragment's change in each window (:mod:`verification.binding`).
    """

    def __init__(
        self, settings: TraceSettings, identity: Identity, plan: FragmentPlan | None = None
    ) -> None:
        if settings.steps < 1:
            raise ValueError("trust.replay_steps must be at least 1 to trace")
        self.identity = identity
        self.settings = settings
        self.sketcher = Sketcher(settings.run_id)
        self.plan = plan
        self.fragments = len(plan) if plan is not None else 1
        self._owners: list[int] | None = None
        """The fragment of each parameter tensor, in the model's order."""
        self.snapshots = 0
        """Start states packed so far."""
        self._seconds = 0.0
        """The training thread's time in the trace so far (:meth:`spent`)."""
        self._open: _Open | None = None
        self._model: nn.Module | None = None
        self._params: list[torch.Tensor] = []
        """The model's parameters (updated in place by every step)."""
        self._end: tuple[torch.Tensor, torch.Tensor] | None = None
        """The last window's end sketch, and its probe."""
        self._background = TimedExecutor("atoll-trace")
        """Hashes start states beside the training thread, and spills them."""
        self._places: list[torch.Tensor | None] | None = None
        """Each parameter tensor's probed places (None: not probed)."""
        self._done: list[TraceWindow] = []
        self._moved: dict[tuple[int, int], torch.Tensor] = {}
        """Each fragment's change over a done window, by its ``(stream, start)``."""
        self.states = StateStore(settings.spill, settings.memory, self._background)
        """The windows' start states, in memory or spilled to files."""
        self._traces: dict[tuple[int, int], _Kept] = {}
        self._lock = threading.Lock()

    # ---- the training thread -------------------------------------------------------------

    @_timed
    def before(
        self, model: nn.Module, optimizer: Any, steps: int, at: tuple[int, int] | None
    ) -> None:
        """An inner step is about to start at draw ``at = (stream, position)`` (None: the
        stream is not an assigned one, nothing is traced), the trainer at ``steps``."""
        if model is not self._model:
            self._model, self._params = model, list(model.parameters())
        params = self._params
        if self._owners is None:
            module = getattr(model, "module", model)  # a DDP site's names are the module's
            names = [n for n, _ in module.named_parameters()]
            self._owners = self.plan.owners(names) if self.plan else [0] * len(names)
        probe = self._probe(params)
        w = self._open
        if w is not None and (
            at is None
            or (w.stream, w.start + len(w.losses) * w.accum) != at
            or (w.probed is not None and not torch.equal(probe, w.probed))
        ):
            self._close(probe)  # the stream changed, or the model did unannounced (dropped)
        if at is None or self._open is not None:
            return
        snapshot = Snapshot(params, optimizer, self.states.reuse(), self._background)
        self.snapshots += 1
        # the last window's end is this one's start where nothing else moved the model
        end = self._end
        begin = end[0] if end is not None and torch.equal(probe, end[1]) else self._sketch(params)
        self._open = _Open(at[0], at[1], steps, self.settings.accum, snapshot, begin)

    @_timed
    def after(self, model: nn.Module, loss: float) -> None:
        """The step ended with mean loss ``loss``."""
        w = self._open
        if w is None:
            return
        w.losses.append(float(loss))
        w.probed = self._probe(self._params)
        if len(w.losses) >= self.settings.steps:
            self._close(w.probed)

    @_timed
    def seal(self) -> None:
        """Something other than an inner step is about to change the model (a sync
        applied, a catch-up): the open window ends here."""
        self._close()

    def _probe(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A few values of every fragment, at fixed places: what tells a step's model from
        one a sync or a catch-up changed since (they change every value of a fragment).
        :data:`_PROBES` values of at most :data:`_PROBED` tensors a fragment, the first
        and the last among them, gathered where they live and copied out once."""
        if self._places is None or len(self._places) != len(params):
            assert self._owners is not None
            g = torch.Generator().manual_seed(0)
            chosen: set[int] = set()
            for f in sorted(set(self._owners)):
                mine = [i for i, o in enumerate(self._owners) if o == f]
                picks = torch.linspace(0, len(mine) - 1, min(_PROBED, len(mine))).round()
                chosen |= {mine[int(k)] for k in picks.tolist()}
            self._places = [
                torch.randint(0, max(1, p.numel()), (min(_PROBES, p.numel()),), generator=g).to(
                    p.device
                )
                if i in chosen
                else None
                for i, p in enumerate(params)
            ]
        with torch.no_grad():
            values = [
                p.detach().reshape(-1)[i].float()
                for p, i in zip(params, self._places)
                if i is not None
            ]
            return torch.cat(values).cpu()

    def _sketch(self, params: list[torch.Tensor]) -> torch.Tensor:
        assert self._owners is not None
        return self.sketcher.by_fragment(params, self._owners, self.fragments)

    def _close(self, probe: torch.Tensor | None = None) -> None:
        """End the open window after its last step: its end sketch, its start state
        kept. A window whose model changed since its last step without :meth:`seal` is
        dropped (its end is not known): no claim can name its batches. ``probe``: the
        model's probe now, where the caller just took it."""
        w, self._open = self._open, None
        if w is None:
            return
        if w.losses and probe is None:
            probe = self._probe(self._params)
        if probe is None or w.probed is None or not torch.equal(probe, w.probed):
            if w.losses:
                logger.warning("a traced window was dropped: the model changed unannounced")
            self.states.release(w.snapshot)
            return
        end = self._sketch(self._params)
        self._end = (end, probe)
        moved = end - w.begin
        self.states.store(w.snapshot)
        window = TraceWindow(
            w.stream,
            w.start,
            len(w.losses),
            w.accum,
            w.step,
            w.snapshot.digest,
            tuple(w.losses),
            tuple(moved.sum(0).tolist()),
        )
        with self._lock:
            self._done.append(window)
            self._moved[(w.stream, w.start)] = moved

    @_timed
    def claim(self, claim: WorkClaim, round_: int, fragment: int) -> WorkClaim:
        """``claim`` with the digest of its signed trace: the windows of its batches."""
        self._close()
        spans = claim.spans
        inside = [self._of(w, fragment) for w in self._done if any(_within(w, s) for s in spans)]
        shape = (claim.ranks, claim.slice[0], claim.slice[1], claim.batch)
        me, run_id = self.identity.peer_id, self.settings.run_id
        trace = Trace(me, run_id, round_, fragment, tuple(inside), spans, shape)
        trace = trace.signed(self.identity)
        with self._lock:
            self._traces[(round_, fragment)] = _Kept(
                trace.to_bytes(), tuple(w.state for w in inside)
            )
            for old in [k for k in self._traces if k[0] <= round_ - ROUNDS_KEPT]:
                del self._traces[old]
        return dataclasses.replace(claim, trace=trace.digest)

    def drawn(self, round_: int, fragment: int, seed: bytes, checker: str | None) -> None:
        """Exchange ``(round_, fragment)``'s seed is known: of this node's trace of its
        contribution to it, only the start state of the window ``checker`` replays
        (:func:`~verification.replay.drawn_window`) is kept from now on; none where no
        one replays it (``checker`` None). Called once the round ended, on the checks'
        worker."""
        with self._lock:
            kept = self._traces.get((round_, fragment))
            if kept is None or kept.drawn:
                return
            states = kept.states
            index = drawn_window(seed, checker, len(states)) if checker and states else None
            kept.states = (states[index],) if index is not None else ()
            kept.drawn = True
            dropped = self._purge()
        unlink(dropped)

    def _of(self, w: TraceWindow, fragment: int) -> TraceWindow:
        """``w`` as fragment ``fragment``'s trace holds it: with that fragment's change."""
        moved = self._moved.get((w.stream, w.start))
        if self.plan is None or moved is None or fragment >= len(moved):
            return w
        return dataclasses.replace(w, moved=tuple(moved[fragment].tolist()))

    @_timed
    def keep(self, open_spans: Sequence[tuple[int, int, int]]) -> None:
        """Drop every window (and its state) that no kept trace names and no claim to come
        can name (``open_spans``: the spans not claimed yet, of every fragment)."""
        with self._lock:
            self._done = [w for w in self._done if any(_within(w, s) for s in open_spans)]
            done = {(w.stream, w.start) for w in self._done}
            self._moved = {k: v for k, v in self._moved.items() if k in done}
            dropped = self._purge()
        unlink(dropped)

    def _purge(self) -> list[Snapshot | Path]:
        """Drop the states that no kept trace and no window to be claimed names (their
        files are removed by the caller, once it holds no lock). Holds ``_lock``."""
        named = {d for kept in self._traces.values() for d in kept.states}
        named |= {w.state for w in self._done}
        return self.states.keep_only(named)

    # ---- serving (the transport's loop) ---------------------------------------------------

    async def serve(self, peer: str, request: bytes) -> bytes:
        """The :data:`REPLAY_RPC` handler."""
        try:
            fields = msgpack.unpackb(request, raw=False)
            if not isinstance(fields, list) or not fields:
                raise ValueError("expected a list")
            if fields[0] == "trace" and len(fields) == 3:
                with self._lock:
                    kept = self._traces.get((int(fields[1]), int(fields[2])))
                return kept.data if kept is not None else b""
            if fields[0] == "state" and len(fields) == 2 and isinstance(fields[1], str):
                return self.states.read(fields[1])
            raise ValueError(f"unknown request {fields[0]!r}")
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ProtocolError("malformed", f"replay request: {exc}", peer) from None

    def spent(self) -> float:
        """Seconds the trace took so far: the training thread's and its own thread's."""
        return self._seconds + self._background.seconds

    def flush(self) -> None:
        """Wait until the trace's thread has hashed and written every state handed to it."""
        self._background.submit(lambda: None).result()

    def kept_bytes(self) -> int:
        """Bytes of start states kept now, in memory and spilled."""
        return self.states.kept_bytes()

    def summary(self) -> dict[str, float]:
        """Windows snapshotted so far, the bytes of start states kept now, and the
        seconds spent on the trace: in all, and of them on its own thread (the round
        event's ``trace``)."""
        return {
            "snapshots": self.snapshots,
            "kept_bytes": self.kept_bytes(),
            "seconds": round(self.spent(), 3),
            "thread_seconds": round(self._background.seconds, 3),
        }

    def close(self) -> None:
        """Remove the spilled states (they are of no use to a later run)."""
        self._background.shutdown(cancel_futures=True)
        self.states.close()


def _within(w: TraceWindow, span: tuple[int, int, int]) -> bool:
    stream, start, count = span
    return w.stream == stream and start <= w.start and w.start + w.draws <= start + count
