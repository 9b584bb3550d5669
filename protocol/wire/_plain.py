"""The plain codecs' payloads: ``none``, ``fp16`` and ``bf16``, every value whole.

``none`` is raw little-endian float32, 4 bytes a value; ``fp16`` and ``bf16`` are a
cast to half precision, 2 bytes a value. A payload's length is ``numel`` times the
width; :mod:`protocol.wire.codec` checks it before any of these run. Decoding checks
that every value is finite, in the same pass as the norm where one is wanted.
"""

from __future__ import annotations

import math

import torch

from protocol.wire._tensorbytes import (
    CodecError,
    all_finite,
    require_finite,
    to_bytes,
    view_bytes,
)

__all__ = [
    "BYTES_PER_VALUE",
    "CODECS",
    "decode",
    "decode_range",
    "decode_with_norm",
    "encode",
    "norm_of_finite",
]

BYTES_PER_VALUE = {"none": 4, "fp16": 2, "bf16": 2}
CODECS = tuple(BYTES_PER_VALUE)
_HALF_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def encode(flat: torch.Tensor, codec: str, copy: bool) -> bytes | memoryview:
    """The payload of ``flat`` (float32; a non-finite value, or one beyond the half
    range, raises ValueError); for ``none`` a view of ``flat`` unless ``copy``."""
    if codec == "none":
        require_finite(flat)
        return to_bytes(flat) if copy else view_bytes(flat)
    half = flat.to(_HALF_DTYPE[codec])
    if not all_finite(half):
        require_finite(flat)
        raise ValueError(f"input has values beyond the {codec} range")
    return to_bytes(half)


def _values(raw: torch.Tensor, codec: str, copy: bool) -> torch.Tensor:
    """The float32 values of a payload's bytes (a view of them for ``none`` unless
    ``copy``)."""
    if codec == "none":
        return (raw.clone() if copy else raw).view(torch.float32)
    return raw.clone().view(_HALF_DTYPE[codec]).float()


def _require_finite(out: torch.Tensor, codec: str) -> torch.Tensor:
    if not all_finite(out):
        raise CodecError("non_finite", f"{codec} payload holds inf or NaN")
    return out


def decode(raw: torch.Tensor, codec: str, copy: bool) -> torch.Tensor:
    """The values of a payload, all finite (else :class:`CodecError` ``non_finite``)."""
    return _require_finite(_values(raw, codec, copy), codec)


def decode_range(raw: torch.Tensor, codec: str, lo: int, hi: int) -> torch.Tensor:
    """Values ``lo:hi`` of a payload, checked as :func:`decode` checks the whole."""
    width = BYTES_PER_VALUE[codec]
    return _require_finite(_values(raw[lo * width : hi * width], codec, copy=False), codec)


def decode_with_norm(raw: torch.Tensor, codec: str, copy: bool) -> tuple[torch.Tensor, float]:
    """:func:`decode` and the values' Euclidean norm in one pass: a finite norm means
    finite values; finite values whose squares overflow float32 get their norm in
    float64."""
    out = _values(raw, codec, copy)
    norm = float(torch.linalg.vector_norm(out))
    if not math.isfinite(norm):
        _require_finite(out, codec)
        norm = norm_of_finite(out)
    return out, norm


def norm_of_finite(t: torch.Tensor) -> float:
    """The Euclidean norm of finite values, in float64 where float32 overflows."""
    norm = float(torch.linalg.vector_norm(t))
    if math.isfinite(norm):
        return norm
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))
