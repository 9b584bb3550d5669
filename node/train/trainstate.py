"""A trainer's state packed: the parameters and the inner optimizer's buffers, as a
replay check needs them at the start of a window (:mod:`node.checks.trace` keeps them,
:mod:`node.checks.replay` loads them).

A :class:`Snapshot` copies the state (to the CPU) and hashes it with BLAKE3, on the
calling thread or on an executor's (BLAKE3 lets go of the GIL while it hashes, so that
runs beside the next inner steps); it is packed only when served: ``u64 header length | msgpack header | every
tensor's bytes, in order``. :func:`load_state` sets a model and an optimizer of the same
kind to a packed state, keeping the optimizer's own hyperparameters (a state sets only
values and buffers, and SOAP's step count).
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import blake3
import msgpack
import torch

__all__ = ["Snapshot", "StateError", "TimedExecutor", "load_state", "pack_state", "state_digest"]

_R = TypeVar("_R")

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


class TimedExecutor(Executor):
    """One worker thread whose jobs' seconds add up in :attr:`seconds` (a trace hashes
    and spills its start states on one, :mod:`node.checks.trace`)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.seconds = 0.0

    def submit(self, fn: Callable[..., _R], /, *args: Any, **kwargs: Any) -> Future[_R]:
        def timed() -> _R:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        return self._pool.submit(timed)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class Snapshot:
    """A window's start state, copied: the parameters and the optimizer's buffers (on
    the CPU), and the structure around them. Packed only when served:
    ``u64 header length | msgpack header | every tensor's bytes, in order``, where the
    header lists each tensor's dtype and shape and holds the optimizers' state with each
    tensor as ``{"__t": index}``. Its digest is BLAKE3 over those bytes, taken over the
    copies without packing them: here, or on ``hasher`` (then :attr:`digest` waits for
    it)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: Any,
        reuse: Snapshot | None = None,
        hasher: Executor | None = None,
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
        self._reuse = []
        self.size = 8 + len(self.header) + sum(t.numel() * t.element_size() for t in self.tensors)
        self._digest: str | Future[str] = (
            self._hash() if hasher is None else hasher.submit(self._hash)
        )

    def _hash(self) -> str:
        h = blake3.blake3(_STATE_DOMAIN)
        h.update(struct.pack("<Q", len(self.header)))
        h.update(self.header)
        for t in self.tensors:
            h.update(_raw(t))
        return h.hexdigest()

    @property
    def digest(self) -> str:
        """The BLAKE3 digest of the packed state (waits for it where it is being taken on
        an executor)."""
        if isinstance(self._digest, Future):
            self._digest = self._digest.result()
        return self._digest

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
        return b"".join(self._pieces())

    def write(self, f: BinaryIO) -> None:
        """Write the packed state to ``f`` without joining it in memory first."""
        for piece in self._pieces():
            f.write(piece)

    def _pieces(self) -> list[bytes | memoryview]:
        return [struct.pack("<Q", len(self.header)), self.header, *(_raw(t) for t in self.tensors)]


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
