"""Tensor codecs for pseudo-gradient traffic.

A pseudo-gradient is flattened to a 1-D float32 vector and encoded with one of
``CODECS``:

* ``none``: raw little-endian float32, 4 bytes a value.
* ``fp16`` / ``bf16``: a cast to half precision, 2 bytes a value (bf16 is its
  raw upper 16 bits of float32).
* ``int8`` / ``int4``: blockwise absmax quantization. Every ``block_size``
  values share one float32 scale ``absmax / qmax`` (qmax 127 or 7) and store
  symmetric codes in ``[-qmax, qmax]``. int4 packs two codes a byte as
  ``code + 8``: element ``2i`` in the low nibble, element ``2i + 1`` in the
  high nibble; an odd count leaves the last high nibble zero.

The payload lays out all block scales first (float32 LE) and then the codes,
so its length is a pure function of ``(numel, codec, block_size)``
(:func:`encoded_size`) and can be checked before anything is parsed. Decoding
treats the payload as untrusted peer data and raises :class:`CodecError` on
anything a correct encoder would not produce.

* ``topk``: in every chunk of ``block_size`` values only the ``k`` of largest
  magnitude, as offsets within the chunk and ``bits``-bit codes with a scale per chunk
  (SparseLoCo's recipe); ``sparse``, on the wire only, every non-zero value in the same
  layout (what an owner's reduction of ``topk`` parts returns: the union of their
  supports). Their payloads carry a count per chunk, so a ``sparse`` payload's length
  is checked against the counts it declares (:mod:`protocol.wire._topk`).

Each family has a module of its own: the plain codecs :mod:`protocol.wire._plain`,
the int8/int4 kernels :mod:`protocol.wire._blockwise`, the sparse ones
:mod:`protocol.wire._topk`; the names, sizes and checks they share are the registry,
:mod:`protocol.wire._registry`; the tensor-to-bytes helpers are in
:mod:`protocol.wire._tensorbytes`, and the error feedback that makes lossy codecs safe
in :mod:`protocol.wire.feedback`. This module is the face over them: the
:class:`Encoded` record, :func:`encode` and :func:`decode`.
"""

from __future__ import annotations

import torch

from protocol.wire import _blockwise, _plain, _topk
from protocol.wire._registry import (
    CODECS,
    DENSE,
    SPARSE,
    WIRE_CODECS,
    Encoded,
    check_settings,
    check_topk,
    encoded_size,
    sparse_result_bound,
    validate,
)
from protocol.wire._tensorbytes import CodecError, as_flat_f32, from_bytes

__all__ = [
    "CODECS",
    "DENSE",
    "SPARSE",
    "WIRE_CODECS",
    "CodecError",
    "Encoded",
    "check_settings",
    "decode",
    "decode_range",
    "decode_with_norm",
    "encode",
    "encoded_size",
    "ready_values",
    "sparse_result_bound",
    "topk_keep_count",
]


def topk_keep_count(density: float, chunk: int) -> int:
    """Values ``topk`` keeps per chunk of ``chunk`` for a kept share ``density``: at
    least one."""
    return _topk.keep_count(density, chunk)


def encode(
    x: torch.Tensor,
    codec: str,
    *,
    block_size: int = 256,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    copy: bool = True,
    k: int = 0,
    bits: int = 0,
) -> Encoded:
    """Encodes a float tensor of any shape and device.

    Args:
        x: floating-point tensor; it is moved to CPU float32 and flattened.
        codec: one of ``WIRE_CODECS``.
        block_size: values per scale for int8/int4 (per chunk for topk/sparse),
            ``1..2**20`` (topk/sparse: ``1..65535``).
        stochastic: round int8/int4/topk codes up with probability equal to the
            fractional part, so that ``E[decode(encode(x))] == x`` (for topk: of the
            kept values). Only int8/int4/topk/sparse support it.
        generator: CPU generator for the rounding noise, for reproducible bytes.
        copy: False lets a ``none`` payload be a view of ``x``'s memory (when ``x`` is
            a contiguous CPU float32 tensor) instead of a copy; ``x`` must then stay
            unchanged while the payload is in use.
        k: values ``topk`` keeps per chunk, ``1..block_size``.
        bits: bits per kept value of ``topk`` and ``sparse``: 2, 4 or 8.

    Returns:
        The encoded tensor.

    Raises:
        TypeError: if ``x`` is not a tensor.
        ValueError: on an unknown codec, a bad block size, stochastic rounding
            for a codec without it, a non-float tensor, non-finite values, or
            values beyond the fp16/bf16 range.
    """
    check_settings(codec, block_size=block_size, stochastic=stochastic, known=WIRE_CODECS)
    flat = as_flat_f32(x)
    if codec in SPARSE:
        return _encode_sparse(flat, codec, block_size, k, bits, stochastic, generator)
    if codec in _plain.CODECS:
        payload = _plain.encode(flat, codec, copy)
    else:
        payload = _blockwise.encode(flat, codec, block_size, stochastic, generator)
    return Encoded(codec=codec, numel=flat.numel(), block_size=block_size, payload=payload)


def _encode_sparse(
    flat: torch.Tensor,
    codec: str,
    chunk: int,
    k: int,
    bits: int,
    stochastic: bool,
    generator: torch.Generator | None,
) -> Encoded:
    """``topk`` keeps ``k`` values a chunk; ``sparse`` every non-zero one (its ``k`` is 0)."""
    kept = k if codec == "topk" else None
    check_topk(chunk, k if codec == "topk" else 1, bits)
    payload = _topk.encode(flat, chunk, kept, bits, stochastic, generator)
    return Encoded(codec, flat.numel(), chunk, payload, k=kept or 0, bits=bits)


def decode(enc: Encoded, *, expected_numel: int | None = None, copy: bool = True) -> torch.Tensor:
    """Decodes an ``Encoded`` that may come from an untrusted peer.

    Args:
        enc: the encoded tensor.
        expected_numel: if given, the numel the caller expects.
        copy: False lets a ``none`` payload be returned as a view of its buffer (no
            copy); the caller must then treat the tensor as read-only and keep the
            buffer unchanged while it uses it. Other codecs always make a new tensor.

    Returns:
        A 1-D float32 CPU tensor of ``enc.numel`` finite values (fresh unless ``copy``
        is False).

    Raises:
        CodecError: on a bad codec, numel, block size or payload type, a payload
            of the wrong length, a numel other than ``expected_numel``, a
            negative or non-finite scale, an out-of-range code, non-zero int4
            padding, or non-finite decoded values.
    """
    validate(enc, expected_numel=expected_numel)
    raw = from_bytes(enc.payload)
    if enc.codec in SPARSE:
        k = enc.k if enc.codec == "topk" else None
        return _topk.decode(raw, enc.numel, enc.block_size, k, enc.bits)
    if enc.codec in _plain.CODECS:
        return _plain.decode(raw, enc.codec, copy)
    return _blockwise.decode(raw, enc.codec, enc.numel, enc.block_size)


def decode_with_norm(
    enc: Encoded, *, expected_numel: int | None = None, copy: bool = True
) -> tuple[torch.Tensor, float]:
    """:func:`decode`, and the Euclidean norm of the values, for what the verification
    layer checks next (screening, a member's check of an owner's result).

    For ``none``, ``fp16`` and ``bf16`` the norm is the finiteness check: one pass where
    :func:`decode` and a norm would take two (a finite norm means finite values; finite
    values whose squares overflow float32 get their norm in float64). Blockwise codecs
    decode to finite values by construction and take one pass for the norm.

    Raises:
        CodecError: as :func:`decode`.
    """
    validate(enc, expected_numel=expected_numel)
    if enc.codec in _plain.CODECS:
        return _plain.decode_with_norm(from_bytes(enc.payload), enc.codec, copy)
    out = decode(enc, copy=copy)
    return out, _plain.norm_of_finite(out)


def ready_values(numel: int, codec: str, block_size: int, nbytes: int) -> int:
    """How many leading values of a payload can be decoded from its first ``nbytes``.

    The scales of ``int8`` and ``int4`` come first, so none is ready before all of them
    are in; after that each code byte completes one value (two for ``int4``).
    """
    if codec in _plain.CODECS:
        return min(numel, nbytes // _plain.BYTES_PER_VALUE[codec])
    if codec in SPARSE:
        return 0  # offsets and codes come after every count: decoded only as a whole
    return _blockwise.ready_values(numel, codec, block_size, nbytes)


def decode_range(enc: Encoded, lo: int, hi: int) -> torch.Tensor:
    """Values ``lo:hi`` of a payload, decoded and checked as :func:`decode` checks the
    whole (for a part that is still arriving: only the bytes those values need are read).

    ``enc`` must be validated already (:meth:`Encoded.from_meta`). For ``none`` the
    result is a view of the payload; otherwise a new tensor.

    Raises:
        ValueError: ``lo:hi`` is not a range of ``enc``'s values.
        CodecError: a bad scale, an out-of-range code, or a non-finite value in the range.
    """
    if not 0 <= lo <= hi <= enc.numel:
        raise ValueError(f"range {lo}:{hi} of {enc.numel} values")
    if enc.codec in SPARSE:
        return decode(enc)[lo:hi]
    raw = from_bytes(enc.payload)
    if enc.codec in _plain.CODECS:
        return _plain.decode_range(raw, enc.codec, lo, hi)
    return _blockwise.decode_range(raw, enc.codec, enc.numel, enc.block_size, lo, hi)
