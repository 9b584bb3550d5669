"""Sparse payloads: the ``topk`` codec's kept values and the ``sparse`` results they reduce to.

A vector is cut into chunks of ``chunk`` values (the last may be shorter). ``topk``
keeps, in every chunk, the ``k`` values of largest magnitude (all of a chunk shorter
than ``k``); ``sparse`` keeps every non-zero value (an owner's reduction of ``topk``
parts, whose support is the union of its members'). Kept values are quantized to
``bits`` (2, 4 or 8) with one float32 scale per chunk, on ``2**bits`` levels that
leave out zero: code ``c`` means ``(c - h) * scale`` with ``h = (2**bits - 1) / 2``
and ``scale = absmax / h``, so every kept value stays non-zero and the largest one is
exact. The payload is, in this order:

* the chunk scales, float32 LE, one a chunk;
* the kept counts, uint16 LE, one a chunk;
* the kept values' offsets within their chunk, strictly increasing within a chunk: one
  byte each when a chunk holds at most 256 values; 12 bits each when it holds at most
  4096 (two offsets in three bytes, the first in the low 12 bits, a last odd one's
  high nibble zero); uint16 LE otherwise;
* the codes, ``8 / bits`` a byte, the first in the lowest bits, the last byte's unused
  bits zero.

A payload is checked as untrusted peer data: every count within its chunk (and equal
to ``min(k, chunk length)`` for ``topk``), the length exact for those counts, every
offset inside its chunk and the offsets of a chunk strictly increasing, scales finite
and non-negative, padding bits zero.
"""

from __future__ import annotations

import torch

from protocol.wire._tensorbytes import CodecError, require_finite, to_bytes

__all__ = [
    "BITS",
    "MAX_CHUNK",
    "decode",
    "encode",
    "exact_size",
    "keep_count",
    "payload_size",
    "size",
]

BITS = (2, 4, 8)
MAX_CHUNK = 65535  # a count and an offset fit in uint16


def keep_count(density: float, chunk: int) -> int:
    """Values ``topk`` keeps per chunk for a kept share ``density``: at least one."""
    return max(1, min(chunk, round(density * chunk)))


def _index_bytes(chunk: int, total: int) -> int:
    """Bytes ``total`` offsets take in chunks of ``chunk`` values."""
    if chunk <= 256:
        return total
    if chunk <= 4096:
        return -(-3 * total // 2)
    return 2 * total


def _pack_offsets(offsets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Offsets (int64, each below ``chunk``) as the payload's bytes (uint8)."""
    if chunk <= 256:
        return offsets.to(torch.uint8)
    if chunk > 4096:
        return offsets.to(torch.int32).to(torch.int16).view(torch.uint8)
    length = _index_bytes(chunk, offsets.numel())
    if offsets.numel() % 2:
        offsets = torch.nn.functional.pad(offsets, (0, 1))
    pairs = offsets.view(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
    packed = torch.stack((lo & 0xFF, (lo >> 8) | ((hi & 0xF) << 4), hi >> 4), dim=1)
    return packed.to(torch.uint8).view(-1)[:length]


def _unpack_offsets(raw: torch.Tensor, chunk: int, total: int) -> torch.Tensor:
    """The ``total`` offsets :func:`_pack_offsets` wrote in ``raw`` (int64).

    Raises:
        CodecError: ``bad_index`` when a last odd offset's unused nibble is not zero.
    """
    if chunk <= 256:
        return raw.to(torch.int64)
    if chunk > 4096:
        return raw.clone().view(torch.int16).to(torch.int64) & 0xFFFF
    b = raw.to(torch.int64)
    if total % 2:
        if int(b[-1]) >> 4:
            raise CodecError("bad_index", "the bits after the last offset are not zero")
        b = torch.nn.functional.pad(b, (0, 1))
    b = b.view(-1, 3)
    lo = b[:, 0] | ((b[:, 1] & 0xF) << 8)
    hi = (b[:, 1] >> 4) | (b[:, 2] << 4)
    return torch.stack((lo, hi), dim=1).view(-1)[:total]


def _chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def _lengths(numel: int, chunk: int) -> torch.Tensor:
    n = _chunks(numel, chunk)
    lengths = torch.full((n,), chunk, dtype=torch.int64)
    if n and numel % chunk:
        lengths[-1] = numel % chunk
    return lengths


def size(numel: int, chunk: int, total: int, bits: int) -> int:
    """Payload length for ``total`` kept values of ``numel`` in chunks of ``chunk``."""
    return 6 * _chunks(numel, chunk) + _index_bytes(chunk, total) + -(-total * bits // 8)


def exact_size(numel: int, chunk: int, k: int, bits: int) -> int:
    """Payload length of a ``topk`` payload (every chunk keeps ``min(k, its length)``)."""
    full, rest = divmod(numel, chunk)
    return size(numel, chunk, full * min(k, chunk) + min(k, rest), bits)


def payload_size(raw: torch.Tensor, numel: int, chunk: int, bits: int) -> int | None:
    """The length a payload must have for the counts it declares; None when it is too
    short to hold the counts, or a count exceeds its chunk (refused by :func:`decode`)."""
    n = _chunks(numel, chunk)
    if raw.numel() < 6 * n:
        return None
    counts = raw[4 * n : 6 * n].clone().view(torch.int16).to(torch.int64) & 0xFFFF
    if bool((counts > _lengths(numel, chunk)).any()):
        return None
    return size(numel, chunk, int(counts.sum()), bits)


# ---- encode --------------------------------------------------------------------------


def _select_topk(flat: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and (chunk-major, increasing) flat positions of the ``k`` largest
    magnitudes of every chunk."""
    numel = flat.numel()
    full, rest = divmod(numel, chunk)
    counts, positions = [], []
    if full:
        blocks = flat[: full * chunk].view(full, chunk)
        kk = min(k, chunk)
        picked = blocks.abs().topk(kk, dim=1, sorted=False).indices.sort(dim=1).values
        starts = torch.arange(full, dtype=torch.int64).unsqueeze(1) * chunk
        positions.append((picked + starts).view(-1))
        counts.append(torch.full((full,), kk, dtype=torch.int64))
    if rest:
        tail = flat[full * chunk :]
        kr = min(k, rest)
        picked = tail.abs().topk(kr, sorted=False).indices.sort().values
        positions.append(picked + full * chunk)
        counts.append(torch.tensor([kr], dtype=torch.int64))
    if not positions:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(counts), torch.cat(positions)


def _select_nonzero(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = flat.nonzero().view(-1)
    counts = torch.bincount(positions // chunk, minlength=_chunks(flat.numel(), chunk))
    return counts, positions


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    per = 8 // bits
    pad = -codes.numel() % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    return (codes.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, total: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8) * bits
    codes = ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).view(-1)
    if bool(codes[total:].any()):
        raise CodecError("bad_code", "padding bits after the last code are not zero")
    return codes[:total]


def encode(
    flat: torch.Tensor,
    chunk: int,
    k: int | None,
    bits: int,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> bytes:
    """The payload of ``flat`` (finite float32): ``topk`` with ``k``, ``sparse`` (every
    non-zero value) with ``k = None``; codes rounded to the nearest level or, with
    ``stochastic``, to one of the two around the value in proportion (unbiased)."""
    require_finite(flat)
    if k is None:
        counts, positions = _select_nonzero(flat, chunk)
    else:
        counts, positions = _select_topk(flat, chunk, k)
    values = flat[positions]
    owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    absmax = torch.zeros(counts.numel(), dtype=torch.float32)
    absmax.scatter_reduce_(0, owner, values.abs(), "amax")
    half = (2**bits - 1) / 2
    scale = absmax / half
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = values / safe[owner] + half
    if stochastic:
        q = torch.floor(y)
        q += torch.rand(y.shape, generator=generator, dtype=torch.float32) < (y - q)
    else:
        q = y.round()
    codes = q.clamp_(0, 2**bits - 1).to(torch.uint8)
    offsets = positions - owner * chunk
    return (
        to_bytes(scale)
        + to_bytes(counts.to(torch.int32).to(torch.int16))
        + to_bytes(_pack_offsets(offsets, chunk))
        + to_bytes(_pack(codes, bits))
    )


# ---- decode --------------------------------------------------------------------------


def decode(raw: torch.Tensor, numel: int, chunk: int, k: int | None, bits: int) -> torch.Tensor:
    """The dense values of a payload whose length :func:`payload_size` checked.

    Raises:
        CodecError: ``bad_count`` (a ``topk`` chunk keeping other than ``min(k, its
            length)``), ``bad_index`` (an offset outside its chunk, or offsets not
            strictly increasing), ``bad_scale`` or ``bad_code``.
    """
    n = _chunks(numel, chunk)
    lengths = _lengths(numel, chunk)
    scale = raw[: 4 * n].clone().view(torch.float32)
    counts = raw[4 * n : 6 * n].clone().view(torch.int16).to(torch.int64) & 0xFFFF
    if k is not None and not bool((counts == lengths.clamp(max=k)).all()):
        raise CodecError("bad_count", f"a chunk keeps other than the declared {k} values")
    half = (2**bits - 1) / 2
    if bool(torch.signbit(scale).any()) or not bool(torch.isfinite(scale * half).all()):
        raise CodecError("bad_scale", "topk scale is negative, non-finite or too large")
    total = int(counts.sum())
    width = _index_bytes(chunk, total)
    body = raw[6 * n :]
    offsets = _unpack_offsets(body[:width], chunk, total)
    codes = _unpack(body[width:], bits, total)
    owner = torch.repeat_interleave(torch.arange(n), counts)
    if total and bool((offsets >= lengths[owner]).any()):
        raise CodecError("bad_index", "an offset lies outside its chunk")
    same_chunk = owner[1:] == owner[:-1]
    if bool((same_chunk & (offsets[1:] <= offsets[:-1])).any()):
        raise CodecError("bad_index", "offsets within a chunk are not strictly increasing")
    out = torch.zeros(numel, dtype=torch.float32)
    out[owner * chunk + offsets] = (codes.to(torch.float32) - half) * scale[owner]
    return out
