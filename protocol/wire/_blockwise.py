"""Blockwise absmax quantization kernels: the ``int8`` and ``int4`` codecs' payloads.

Every ``block_size`` values share one float32 scale ``absmax / qmax`` (qmax 127 or 7)
and store symmetric codes in ``[-qmax, qmax]``; the payload is all the scales, then
all the codes (int4 packs two a byte). The layout is described in
:mod:`protocol.wire.codec`, whose registry (:mod:`protocol.wire._registry`) validates
a payload's fields and length before any of these run.
"""

from __future__ import annotations

import torch

from protocol.wire._tensorbytes import CodecError, require_finite, to_bytes

__all__ = ["QMAX", "decode", "decode_range", "encode", "ready_values", "size"]

QMAX = {"int8": 127, "int4": 7}


def size(numel: int, codec: str, block_size: int) -> int:
    """The payload's length: a float32 scale a block, then a byte a code (int4: two
    codes a byte)."""
    n_blocks = -(-numel // block_size)
    code_bytes = numel if codec == "int8" else (numel + 1) // 2
    return 4 * n_blocks + code_bytes


def ready_values(numel: int, codec: str, block_size: int, nbytes: int) -> int:
    """How many leading values the payload's first ``nbytes`` decode: none before every
    scale is in, then one a code byte (two for int4)."""
    scales = 4 * -(-numel // block_size)
    codes = max(0, nbytes - scales)
    return min(numel, codes if codec == "int8" else 2 * codes)


def as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """Views ``flat`` as ``(n_blocks, block_size)``, zero-padding a partial last block."""
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def encode(
    flat: torch.Tensor,
    codec: str,
    block_size: int,
    stochastic: bool,
    generator: torch.Generator | None,
) -> bytes:
    """The payload of ``flat`` (finite float32 values; non-finite ones raise ValueError),
    codes rounded to nearest or, with ``stochastic``, up with the fractional part's
    probability."""
    n = flat.numel()
    qmax = QMAX[codec]
    blocks = as_blocks(flat, block_size)
    # aminmax avoids materializing |x|, and it propagates NaN and inf, so checking the
    # n / block_size block maxima covers the whole input.
    lo, hi = torch.aminmax(blocks, dim=1)
    # abs_ turns the -0.0 of an all-zero block into the +0.0 that decode requires.
    absmax = torch.maximum(lo.neg_(), hi).abs_()
    if not bool(torch.isfinite(absmax).all()):
        require_finite(flat)
    scale = absmax / qmax
    # Near float32 max, qmax * scale can round up to inf; step the scale down one ulp so
    # decode never overflows (the clamp below absorbs the tiny excess in the codes).
    overflow = torch.isinf(scale * qmax)
    if bool(overflow.any()):
        scale = torch.where(overflow, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    # An all-zero block (or one whose scale underflows) divides by 1 and yields zero codes.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = blocks / safe.unsqueeze(1)
    if stochastic:
        q = torch.floor(y)
        # y - floor(y) is exact in float32, so P(round up) equals the fractional part.
        noise = torch.rand(y.shape, generator=generator, dtype=torch.float32)
        q += noise < y.sub_(q)
    else:
        q = y.round_()
    codes = q.clamp_(-qmax, qmax).view(-1)[:n].to(torch.int8)
    if codec == "int4":
        codes = pack_int4(codes)
    return to_bytes(scale) + to_bytes(codes)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte as ``code + 8``: element ``2i`` low, ``2i + 1`` high."""
    nibbles = (codes + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[0::2] | (nibbles[1::2] << 4)


def _check_scales(scale: torch.Tensor, codec: str) -> None:
    # signbit also catches -0.0 and negative NaN: a correct encoder never emits them.
    if bool(torch.signbit(scale).any()) or not bool(torch.isfinite(scale * QMAX[codec]).all()):
        raise CodecError("bad_scale", f"{codec} scale is negative, non-finite or too large")


def decode(raw: torch.Tensor, codec: str, n: int, block_size: int) -> torch.Tensor:
    """The ``n`` values of a payload of the right length, checked as a peer's.

    Raises:
        CodecError: ``bad_scale`` or ``bad_code``.
    """
    n_blocks = -(-n // block_size)
    scale = raw[: 4 * n_blocks].clone().view(torch.float32)
    _check_scales(scale, codec)
    body = raw[4 * n_blocks :]
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    if codec == "int8":
        codes = body.view(torch.int8)
        if int(codes.min()) == -128:
            raise CodecError("bad_code", "int8 code -128 is outside [-127, 127]")
    else:
        nibbles = torch.stack((body & 0x0F, body >> 4), dim=1).view(-1)
        if n % 2 and int(nibbles[n]) != 0:
            raise CodecError("bad_code", "int4 padding nibble is not zero")
        nibbles = nibbles[:n]
        if int(nibbles.min()) == 0:
            raise CodecError("bad_code", "int4 nibble 0 (code -8) is outside [-7, 7]")
        codes = nibbles.view(torch.int8).sub_(8)
    # int8 times float32 promotes to float32 in the same pass as the scaling.
    values = as_blocks(codes, block_size) * scale.unsqueeze(1)
    return values.view(-1)[:n].clone() if n % block_size else values.view(-1)


def decode_range(
    raw: torch.Tensor, codec: str, numel: int, block_size: int, lo: int, hi: int
) -> torch.Tensor:
    """Values ``lo:hi`` of a payload of the right length for ``numel`` values, reading
    only the scales and codes they need, checked as :func:`decode` checks the whole.

    Raises:
        CodecError: ``bad_scale`` or ``bad_code``.
    """
    if lo == hi:
        return torch.empty(0, dtype=torch.float32)
    b = block_size
    n_blocks = -(-numel // b)
    first, last = lo // b, (hi - 1) // b
    scale = raw[4 * first : 4 * (last + 1)].clone().view(torch.float32)
    _check_scales(scale, codec)
    body = raw[4 * n_blocks :]
    if codec == "int8":
        codes = body[lo:hi].view(torch.int8)
        if int(codes.min()) == -128:
            raise CodecError("bad_code", "int8 code -128 is outside [-127, 127]")
    else:
        packed = body[lo // 2 : (hi + 1) // 2]
        nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=1).view(-1)
        if hi == numel and numel % 2 and int(nibbles[-1]) != 0:
            raise CodecError("bad_code", "int4 padding nibble is not zero")
        nibbles = nibbles[lo % 2 : lo % 2 + hi - lo]
        if int(nibbles.min()) == 0:
            raise CodecError("bad_code", "int4 nibble 0 (code -8) is outside [-7, 7]")
        codes = nibbles.view(torch.int8).sub(8)
    index = torch.arange(lo, hi) // b - first
    return codes.to(torch.float32) * scale.index_select(0, index)
