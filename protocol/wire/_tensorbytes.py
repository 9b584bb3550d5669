"""Tensors as wire bytes: flat float32 input, byte views and copies, finiteness checks.

Payloads are made by viewing tensor memory as bytes, so they are little-endian only on
a little-endian host; importing this module anywhere else fails rather than emit the
wrong wire format. :class:`CodecError` is what a peer's bad payload raises.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from protocol.errors import ProtocolError

__all__ = [
    "CodecError",
    "all_finite",
    "as_flat_f32",
    "from_bytes",
    "require_finite",
    "to_bytes",
    "view_bytes",
]

if sys.byteorder != "little":
    # Payloads are produced by viewing tensor memory as bytes; a big-endian host would
    # silently emit the wrong wire format instead of failing.
    raise ImportError("protocol.wire.codec requires a little-endian host")


class CodecError(ProtocolError):
    """An encoded tensor from a peer that is malformed, inconsistent or out of range."""


def as_flat_f32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    return x.detach().to(device="cpu", dtype=torch.float32).reshape(-1)


def all_finite(t: torch.Tensor) -> bool:
    # aminmax propagates NaN and inf in one pass; torch.isfinite(t).all() is several
    # times slower on CPU and dominated the cost of the cheap codecs.
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def require_finite(flat: torch.Tensor) -> None:
    if not all_finite(flat):
        bad = int((~torch.isfinite(flat)).sum())
        raise ValueError(f"cannot encode a tensor with {bad} non-finite value(s) (inf or NaN)")


def to_bytes(t: torch.Tensor) -> bytes:
    # Viewing as uint8 first keeps numpy away from dtypes it lacks (bfloat16).
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def view_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def from_bytes(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    if not memoryview(payload).nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # bytes are read-only; every caller copies or only reads, so the warning is noise.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)
