"""The node's trace of its own training, kept so that checkers can replay it.

With ``trust.replay_steps = w`` the training loop tells :class:`Tracer` about every
inner step. The tracer cuts the steps into windows of at most ``w``: a window starts
with a snapshot of the trained model's parameters and inner optimizer state (packed by
:func:`pack_state`, kept in memory under its digest) and ends after ``w`` steps, or
earlier where anything but an inner step changed the parameters (a sync applied, a
catch-up: values probed before a step differ from those after the step before), the
stream changed, or a sync takes its claim. When a sync takes its claim
(:meth:`Tracer.claim`), the windows of the claimed batches become a signed
:class:`~verification.replay.Trace` whose digest goes into the claim, and so into every
part and the commitment. The tracer serves traces and start states on
:data:`REPLAY_RPC` for :data:`~protocol.averaging.contributions.ROUNDS_KEPT` rounds.

What it costs: a sketch a step (one pass over the parameters) and a few probed values
before and after it, and one copied state per window (hashed with BLAKE3 as it is
copied), 12 bytes a parameter with AdamW, kept while a claim may still name
it: in memory up to :data:`MEMORY_BYTES`, beyond that in files of the node's
``trace/`` folder (docs/trust.md, "Replay checks").
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import msgpack
import torch
from torch import nn

from protocol.averaging.contributions import ROUNDS_KEPT, WorkClaim
from protocol.errors import ProtocolError
from verification.identity import Identity
from verification.replay import Sketcher, Trace, TraceWindow

__all__ = [
    "REPLAY_RPC",
    "Snapshot",
    "StateError",
    "Tracer",
    "load_state",
    "pack_state",
    "state_digest",
]

REPLAY_RPC = "atoll.replay"
"""``msgpack(["trace", round, fragment])`` for a signed trace, ``msgpack(["state",
digest])`` for a window's packed start state; an empty answer when it is not kept."""
_FREE = 2
"""Dropped snapshots kept for their memory."""
_PROBES = 16
"""Values of each parameter tensor probed before and after every step."""
MEMORY_BYTES = 1 << 30
"""Bytes of start states a node keeps in memory; beyond them, in files."""
_VERSION = 2
_MAX_HEADER = 64 << 20
_STATE_DOMAIN = b"atoll/train-state/v2\0"
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


class StateError(ValueError):
    """A packed training state that does not fit the model or its optimizer."""


class Snapshot:
    """A window's start state, copied: the parameters and the optimizer's buffers (on
    the CPU), and the structure around them. Packed only when served:
    ``u64 header length | msgpack header | every tensor's bytes, in order``, where the
    header lists each tensor's dtype and shape and holds the optimizers' state with each
    tensor as ``{"__t": index}``. Its digest is BLAKE3 over those bytes, taken here over
    the copies, without packing them."""

    def __init__(
        self, params: Sequence[torch.Tensor], optimizer: Any, reuse: Snapshot | None = None
    ) -> None:
        self._reuse = reuse.tensors if reuse is not None else []
        self.tensors: list[torch.Tensor] = []
        with torch.no_grad():
            for p in params:
                self._keep(p)
            states = [
                {
                    "state": self._tree(s["state"]),
                    "steps": [g.get("step") for g in s["param_groups"]],
                }
                for s in _optimizer_states(optimizer)
            ]
        described = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in self.tensors]
        self.header = msgpack.packb(
            {"v": _VERSION, "params": len(params), "tensors": described, "state": states},
            use_bin_type=True,
        )
        h = blake3.blake3(_STATE_DOMAIN)
        h.update(struct.pack("<Q", len(self.header)))
        h.update(self.header)
        for t in self.tensors:
            h.update(_raw(t))
        self.digest = h.hexdigest()
        self._reuse = []
        self.size = 8 + len(self.header) + sum(t.numel() * t.element_size() for t in self.tensors)

    def _keep(self, t: torch.Tensor) -> int:
        """Copy ``t`` into the snapshot (into a dropped one's tensor where it fits: writing
        into memory already mapped is about twice as fast as a fresh copy)."""
        i = len(self.tensors)
        old = self._reuse[i] if i < len(self._reuse) else None
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            self.tensors.append(old.copy_(t.detach()))
        else:
            self.tensors.append(t.detach().to("cpu", copy=True).contiguous())
        return i

    def _tree(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {"__t": self._keep(value)}
        if isinstance(value, dict):
            return {k: self._tree(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._tree(v) for v in value]
        return value

    def pack(self) -> bytes:
        return b"".join(
            [struct.pack("<Q", len(self.header)), self.header, *(_raw(t) for t in self.tensors)]
        )


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def state_digest(packed: bytes) -> str:
    """The digest a trace names a packed start state by (:class:`Snapshot`)."""
    return blake3.blake3(_STATE_DOMAIN + packed).hexdigest()


def pack_state(params: Sequence[torch.Tensor], optimizer: Any) -> bytes:
    """The parameters' values and the inner optimizer's state, packed (a window's start)."""
    return Snapshot(params, optimizer).pack()


def _unpack(data: bytes) -> tuple[int, list[torch.Tensor], Any]:
    """``(parameters, tensors, optimizers' states)`` of a packed state."""
    if not isinstance(data, bytes) or len(data) < 8:
        raise StateError("not a packed state")
    (length,) = struct.unpack("<Q", data[:8])
    if length > min(len(data) - 8, _MAX_HEADER):
        raise StateError("a packed state's header runs past its end")
    try:
        fields = msgpack.unpackb(data[8 : 8 + length], raw=False, strict_map_key=False)
    except Exception as exc:
        raise StateError(f"not a packed state: {type(exc).__name__}") from None
    if not isinstance(fields, dict) or set(fields) != {"v", "params", "tensors", "state"}:
        raise StateError("a packed state holds v, params, tensors and state")
    if fields["v"] != _VERSION or not isinstance(fields["tensors"], list):
        raise StateError(f"not a version-{_VERSION} state")
    tensors, at = [], 8 + length
    for described in fields["tensors"]:
        if not isinstance(described, list) or len(described) != 2:
            raise StateError("a tensor is described by [dtype, shape]")
        dtype, shape = described
        if dtype not in _DTYPES or not isinstance(shape, list):
            raise StateError(f"a tensor of dtype {dtype!r}")
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40 for n in shape
        ):
            raise StateError("a tensor's shape holds sizes")
        dt = _DTYPES[dtype]
        size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        if at + size > len(data):
            raise StateError("a packed state's tensors run past its end")
        raw = bytearray(data[at : at + size])
        tensors.append(
            torch.frombuffer(raw, dtype=dt).reshape(shape) if size else torch.empty(shape, dtype=dt)
        )
        at += size
    if at != len(data):
        raise StateError("a packed state's bytes do not match its tensors")
    count = fields["params"]
    if not isinstance(count, int) or not 0 <= count <= len(tensors):
        raise StateError("a packed state's parameter count is out of range")
    return count, tensors, fields["state"]


def _untree(value: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    if depth > 8:
        raise StateError("an optimizer state nested too deep")
    if isinstance(value, dict):
        if set(value) == {"__t"}:
            index = value["__t"]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise StateError("an optimizer state names a tensor it does not hold")
            return tensors[index]
        if not all(isinstance(k, int | str) for k in value):
            raise StateError("an optimizer state's keys are indices or names")
        return {k: _untree(v, tensors, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_untree(v, tensors, depth + 1) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise StateError(f"an optimizer state holds a {type(value).__name__}")


def _optimizer_states(optimizer: Any) -> list[dict]:
    state = optimizer.state_dict()
    return list(state["optimizers"]) if "optimizers" in state else [state]


def load_state(data: bytes, params: Sequence[torch.Tensor], optimizer: Any) -> None:
    """Set ``params`` and ``optimizer`` (of the same model and ``train.optimizer``) to a
    packed state. The optimizer keeps its own hyperparameters: a state sets only the
    values and the per-parameter buffers.

    Raises:
        StateError: the bytes are malformed or do not fit the model or its optimizer.
    """
    count, tensors, states = _unpack(data)
    values = tensors[:count]
    if len(values) != len(params) or any(
        v.shape != p.shape or v.dtype != p.dtype for v, p in zip(values, params, strict=True)
    ):
        raise StateError("its parameters are not this model's")
    if not all(torch.isfinite(v).all() for v in values if v.is_floating_point()):
        raise StateError("its parameters hold non-finite values")
    own = _optimizer_states(optimizer)
    if not isinstance(states, list) or len(states) != len(own):
        raise StateError("its optimizer state is not this optimizer's")
    loaded = [_optimizer_state(st, mine, tensors) for st, mine in zip(states, own, strict=True)]
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
    try:
        if "optimizers" in optimizer.state_dict():
            optimizer.load_state_dict({"optimizers": loaded})
        else:
            optimizer.load_state_dict(loaded[0])
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise StateError(f"its optimizer state does not load: {exc}") from None


def _optimizer_state(served: Any, mine: dict, tensors: list[torch.Tensor]) -> dict:
    """One optimizer's served buffers under this node's own hyperparameters: of a
    parameter group only its step count (SOAP keeps one) is taken."""
    if not isinstance(served, dict) or set(served) != {"state", "steps"}:
        raise StateError("an optimizer's state holds its buffers and its groups' steps")
    state, steps = _untree(served["state"], tensors), served["steps"]
    if not isinstance(state, dict):
        raise StateError("an optimizer state maps parameters to buffers")
    groups = [dict(g) for g in mine["param_groups"]]
    if not isinstance(steps, list) or len(steps) != len(groups):
        raise StateError("an optimizer state's groups are not this optimizer's")
    for group, step in zip(groups, steps, strict=True):
        if step is None:
            group.pop("step", None)
        elif isinstance(step, int | float) and not isinstance(step, bool) and 0 <= step < 2**53:
            group["step"] = step
        else:
            raise StateError("a group's step count is a number")
    return {"state": state, "param_groups": groups}


@dataclass
class _Open:
    """The window being recorded."""

    stream: int
    start: int
    step: int
    accum: int
    state: str
    begin: torch.Tensor
    losses: list[float] = field(default_factory=list)


class Tracer:
    """This node's trace (see the module docstring).

    Args:
        identity: signs traces.
        run_id: the run (the sketches' seed).
        steps: the longest window (``trust.replay_steps``).
        accum: draws per step (``train.grad_accum``).
        spill: a folder for start states beyond ``memory`` bytes (None: all in memory).
        memory: bytes of start states kept in memory before they go to ``spill``.
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        steps: int,
        accum: int,
        spill: Path | None = None,
        memory: int = MEMORY_BYTES,
    ) -> None:
        if steps < 1:
            raise ValueError("trust.replay_steps must be at least 1 to trace")
        self.identity = identity
        self.run_id = run_id
        self.steps = steps
        self.accum = accum
        self.sketcher = Sketcher(run_id)
        self.snapshots = 0
        """Start states packed so far."""
        self._open: _Open | None = None
        self._last: torch.Tensor | None = None
        """The sketch after the last step traced."""
        self._probed: torch.Tensor | None = None
        """Its probe (:meth:`_probe`)."""
        self._places: list[torch.Tensor] | None = None
        self._free: list[Snapshot] = []
        """Dropped snapshots whose memory the next ones are copied into."""
        self._done: list[TraceWindow] = []
        self.spill = spill
        self.memory = memory
        if spill is not None and spill.is_dir():  # left by a node that did not stop cleanly
            for stale in [*spill.glob("*.state"), *spill.glob("*.part")]:
                stale.unlink(missing_ok=True)
        self._states: dict[str, Snapshot | Path] = {}
        self._in_memory = 0
        self._traces: dict[tuple[int, int], tuple[bytes, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    # ---- the training thread -------------------------------------------------------------

    def before(
        self, model: nn.Module, optimizer: Any, steps: int, at: tuple[int, int] | None
    ) -> None:
        """An inner step is about to start at draw ``at = (stream, position)`` (None: the
        stream is not an assigned one, nothing is traced), the trainer at ``steps``."""
        params = list(model.parameters())
        probe = self._probe(params)
        unchanged = self._probed is not None and torch.equal(probe, self._probed)
        w = self._open
        if w is not None and (
            at is None
            or (w.stream, w.start + len(w.losses) * w.accum) != at
            or len(w.losses) >= self.steps
            or not unchanged
        ):
            self._close()
        if at is None or self._open is not None:
            return
        with self._lock:
            reuse = self._free.pop() if self._free else None
        snapshot = Snapshot(params, optimizer, reuse)
        self._store(snapshot)
        self.snapshots += 1
        # the last step's sketch is this state's where nothing else moved the model
        begin = self._last if unchanged and self._last is not None else self.sketcher.sketch(params)
        self._open = _Open(at[0], at[1], steps, self.accum, snapshot.digest, begin)

    def _probe(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A few values of every parameter, at fixed places: what tells a step's model from
        one a sync or a catch-up changed since (they change every value of a fragment)."""
        if self._places is None or len(self._places) != len(params):
            g = torch.Generator().manual_seed(0)
            self._places = [
                torch.randint(0, max(1, p.numel()), (min(_PROBES, p.numel()),), generator=g).to(
                    p.device
                )
                for p in params
            ]
        with torch.no_grad():
            return torch.cat(
                [p.detach().reshape(-1)[i].float().cpu() for p, i in zip(params, self._places)]
            )

    def _store(self, snapshot: Snapshot) -> None:
        """Keep a start state: in memory while they fit in ``memory`` bytes, else in a
        file of the spill folder (written whole, then renamed)."""
        digest = snapshot.digest
        if self.spill is None or self._in_memory + snapshot.size <= self.memory:
            with self._lock:
                self._states[digest] = snapshot
                self._in_memory += snapshot.size
            return
        self.spill.mkdir(parents=True, exist_ok=True)
        path = self.spill / f"{digest}.state"
        part = path.with_suffix(".part")
        part.write_bytes(snapshot.pack())
        os.replace(part, path)
        with self._lock:
            self._states[digest] = path

    def _read(self, digest: str) -> bytes:
        with self._lock:
            kept = self._states.get(digest)
        if kept is None:
            return b""
        if isinstance(kept, Snapshot):
            with self._lock:  # a dropped snapshot's memory is written into again
                return kept.pack() if self._states.get(digest) is kept else b""
        try:
            return kept.read_bytes()
        except OSError:
            return b""

    def after(self, model: nn.Module, loss: float) -> None:
        """The step ended with mean loss ``loss``."""
        if self._open is None:
            self._probed = None
            return
        params = list(model.parameters())
        self._open.losses.append(float(loss))
        self._last = self.sketcher.sketch(params)
        self._probed = self._probe(params)

    def _close(self) -> None:
        w, self._open = self._open, None
        if w is None or not w.losses or self._last is None:
            return
        change = (self._last - w.begin).tolist()
        window = TraceWindow(
            w.stream,
            w.start,
            len(w.losses),
            w.accum,
            w.step,
            w.state,
            tuple(w.losses),
            tuple(change),
        )
        with self._lock:
            self._done.append(window)

    def claim(self, claim: WorkClaim, round_: int, fragment: int) -> WorkClaim:
        """``claim`` with the digest of its signed trace: the windows of its batches."""
        self._close()
        spans = claim.spans
        inside = [w for w in self._done if any(_within(w, s) for s in spans)]
        shape = (claim.ranks, claim.slice[0], claim.slice[1], claim.batch)
        trace = Trace(
            self.identity.peer_id, self.run_id, round_, fragment, tuple(inside), spans, shape
        ).signed(self.identity)
        with self._lock:
            self._traces[(round_, fragment)] = (trace.to_bytes(), tuple(w.state for w in inside))
            for old in [k for k in self._traces if k[0] <= round_ - ROUNDS_KEPT]:
                del self._traces[old]
        return dataclasses.replace(claim, trace=trace.digest)

    def keep(self, open_spans: Sequence[tuple[int, int, int]]) -> None:
        """Drop every window (and its state) that no kept trace names and no claim to come
        can name (``open_spans``: the spans not claimed yet, of every fragment)."""
        with self._lock:
            named = {d for _, states in self._traces.values() for d in states}
            self._done = [w for w in self._done if any(_within(w, s) for s in open_spans)]
            named |= {w.state for w in self._done}
            if self._open is not None:
                named.add(self._open.state)
            dropped = [self._states.pop(d) for d in list(self._states) if d not in named]
            self._in_memory -= sum(v.size for v in dropped if isinstance(v, Snapshot))
            self._free = [v for v in dropped if isinstance(v, Snapshot)][-_FREE:]
        for kept in dropped:
            if isinstance(kept, Path):
                kept.unlink(missing_ok=True)

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
                return kept[0] if kept is not None else b""
            if fields[0] == "state" and len(fields) == 2 and isinstance(fields[1], str):
                return self._read(fields[1])
            raise ValueError(f"unknown request {fields[0]!r}")
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ProtocolError("malformed", f"replay request: {exc}", peer) from None

    def kept_bytes(self) -> int:
        """Bytes of start states kept now, in memory and spilled."""
        with self._lock:
            kept = list(self._states.values())
        return sum(v.size if isinstance(v, Snapshot) else _size(v) for v in kept)

    def summary(self) -> dict[str, int]:
        """Windows snapshotted so far and the bytes of start states kept now (the round
        event's ``trace``)."""
        return {"snapshots": self.snapshots, "kept_bytes": self.kept_bytes()}

    def close(self) -> None:
        """Remove the spilled states (they are of no use to a later run)."""
        with self._lock:
            kept, self._states, self._in_memory = list(self._states.values()), {}, 0
            self._free = []
        for v in kept:
            if isinstance(v, Path):
                v.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _within(w: TraceWindow, span: tuple[int, int, int]) -> bool:
    stream, start, count = span
    return w.stream == stream and start <= w.start and w.start + w.draws <= start + count
