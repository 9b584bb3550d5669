"""The codec registry: every codec's name and family, and the checks all of them share.

The families: plain (``none``, ``fp16``, ``bf16``: :mod:`protocol.wire._plain`),
blockwise (``int8``, ``int4``: :mod:`protocol.wire._blockwise`) and sparse (``topk``,
and ``sparse`` on the wire only: :mod:`protocol.wire._topk`). Here a codec's settings
are checked (:func:`check_settings`), a payload's exact length is computed
(:func:`encoded_size`), and a peer's encoded tensor is validated before any kernel
runs (:func:`validate`, and :class:`Encoded`, the tensor as it travels);
:mod:`protocol.wire.codec` is the face the rest of Atoll uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.wire import _blockwise, _plain, _topk
from protocol.wire._tensorbytes import CodecError, from_bytes

__all__ = [
    "CODECS",
    "DENSE",
    "Encoded",
    "MAX_BLOCK_SIZE",
    "MAX_TOPK_CHUNK",
    "SPARSE",
    "TOPK_BITS",
    "WIRE_CODECS",
    "check_settings",
    "check_topk",
    "encoded_size",
    "is_int",
    "short",
    "sparse_result_bound",
    "validate",
]

DENSE = (*_plain.CODECS, *_blockwise.QMAX)
"""Codecs that send every value."""
CODECS = (*DENSE, "topk")
WIRE_CODECS = (*CODECS, "sparse")
"""Every codec a payload may name: ``sparse`` is what owners answer ``topk`` parts with."""
SPARSE = ("topk", "sparse")
TOPK_BITS = _topk.BITS
MAX_BLOCK_SIZE = 2**20
MAX_TOPK_CHUNK = _topk.MAX_CHUNK
_STOCHASTIC = (*_blockwise.QMAX, *SPARSE)


def encoded_size(numel: int, codec: str, block_size: int, *, k: int = 0, bits: int = 0) -> int:
    """Exact payload length in bytes for a tensor of ``numel`` values.

    Args:
        numel: number of values, ``>= 0``.
        codec: one of ``CODECS`` (``sparse`` has no size known before its counts).
        block_size: values per scale, ``1..2**20`` (checked for every codec).
        k: values ``topk`` keeps per chunk.
        bits: bits per value ``topk`` keeps.

    Raises:
        ValueError: on an unknown codec, a negative numel, a bad block size, or bad
            ``topk`` parameters.
    """
    check_settings(codec, block_size=block_size, k=k, bits=bits)
    if not is_int(numel) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if codec in _plain.BYTES_PER_VALUE:
        return numel * _plain.BYTES_PER_VALUE[codec]
    if codec == "topk":
        return _topk.exact_size(numel, block_size, k, bits)
    return _blockwise.size(numel, codec, block_size)


def sparse_result_bound(numel: int, chunk: int, k: int, members: int, bits: int = 8) -> int:
    """The longest ``sparse`` payload an owner answers ``members`` ``topk`` parts of
    ``numel`` values with: every chunk keeps at most ``members * k`` values (the union
    of their supports), and at most the whole chunk."""
    full, rest = divmod(numel, chunk)
    kept = full * min(members * k, chunk) + min(members * k, rest)
    return _topk.size(numel, chunk, kept, bits)


def check_settings(
    codec: object,
    *,
    block_size: object,
    stochastic: bool = False,
    k: object = None,
    bits: object = None,
    known: tuple[str, ...] = CODECS,
) -> None:
    """Checks a codec's settings (``k`` and ``bits`` only for topk, and only when ``k`` is
    given) against ``known``: ``CODECS`` for a node's own parts, ``WIRE_CODECS`` for
    anything that may be sent.

    Raises:
        ValueError: naming the setting that is wrong.
    """
    _check_codec(codec, known)
    _check_block_size(block_size)
    if stochastic and codec not in _STOCHASTIC:
        raise ValueError(f"stochastic rounding is only implemented for int8/int4/topk, not {codec}")
    if codec == "topk" and k is not None:
        check_topk(block_size, k, bits)


def is_int(v: object) -> bool:
    """Whether ``v`` is an int and not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def short(v: object) -> str:
    """``repr(v)``, cut to 40 characters: peer-supplied values go into log lines, and a
    hostile 1 MB string must not."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_codec(codec: object, known: tuple[str, ...] = CODECS) -> None:
    if codec not in known:
        raise ValueError(f"codec = {codec!r}: expected one of {', '.join(known)}")


def check_topk(chunk: int, k: object, bits: object) -> None:
    """Checks ``topk``'s chunk, ``k`` and ``bits``; ValueError naming the wrong one."""
    if chunk > MAX_TOPK_CHUNK:
        raise ValueError(f"topk chunk = {chunk}: expected at most {MAX_TOPK_CHUNK}")
    if not is_int(k) or not 1 <= k <= chunk:
        raise ValueError(f"topk k = {k!r}: expected an int in 1..{chunk} (the chunk)")
    if bits not in TOPK_BITS:
        raise ValueError(f"topk bits = {bits!r}: expected one of 2, 4, 8")


def _check_block_size(block_size: object) -> None:
    if not is_int(block_size) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size = {block_size!r}: expected an int in 1..{MAX_BLOCK_SIZE}")


def validate(
    enc: Encoded, *, max_numel: int | None = None, expected_numel: int | None = None
) -> None:
    """Checks the fields of a possibly hostile ``Encoded`` before any allocation."""
    if not isinstance(enc.codec, str) or enc.codec not in WIRE_CODECS:
        raise CodecError("unknown_codec", f"codec {short(enc.codec)}")
    if not is_int(enc.numel) or enc.numel < 0:
        raise CodecError("bad_numel", f"numel {short(enc.numel)}")
    if max_numel is not None and enc.numel > max_numel:
        raise CodecError("bad_numel", f"numel {enc.numel} exceeds the limit {max_numel}")
    if not is_int(enc.block_size) or not 1 <= enc.block_size <= MAX_BLOCK_SIZE:
        raise CodecError("bad_block_size", f"block size {short(enc.block_size)}")
    if not isinstance(enc.payload, (bytes, bytearray, memoryview)):
        raise CodecError("bad_payload", f"payload is {type(enc.payload).__name__}, not bytes")
    have = memoryview(enc.payload).nbytes
    if enc.codec in SPARSE:
        _validate_sparse(enc, have)
    else:
        _check_size(enc, have, encoded_size(enc.numel, enc.codec, enc.block_size))
    if expected_numel is not None and enc.numel != expected_numel:
        raise CodecError("numel_mismatch", f"got {enc.numel} values, expected {expected_numel}")


def _validate_sparse(enc: Encoded, have: int) -> None:
    if enc.block_size > MAX_TOPK_CHUNK:
        raise CodecError("bad_block_size", f"topk chunk {enc.block_size} > {MAX_TOPK_CHUNK}")
    if enc.bits not in TOPK_BITS:
        raise CodecError("malformed", f"bits {short(enc.bits)}: expected 2, 4 or 8")
    if enc.codec == "topk":
        if not is_int(enc.k) or not 1 <= enc.k <= enc.block_size:
            raise CodecError("bad_count", f"k {short(enc.k)} outside 1..{enc.block_size}")
        want: int | None = _topk.exact_size(enc.numel, enc.block_size, enc.k, enc.bits)
    else:
        if enc.k != 0:
            raise CodecError("malformed", f"sparse k {short(enc.k)}: expected 0")
        want = _topk.payload_size(from_bytes(enc.payload), enc.numel, enc.block_size, enc.bits)
        if want is None:
            raise CodecError("bad_count", "sparse payload too short or a count beyond its chunk")
    _check_size(enc, have, want)


def _check_size(enc: Encoded, have: int, want: int) -> None:
    if have != want:
        raise CodecError(
            "size_mismatch",
            f"{enc.codec} payload for {enc.numel} values is {have} bytes, expected {want}",
        )


_WIRE_KEYS = frozenset({"c", "n", "b", "p"})
_SPARSE_KEYS = _WIRE_KEYS | {"k", "q"}


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor as it travels on the wire.

    Construction does not validate, so that a peer's message can be held and
    reported; :func:`decode` and :meth:`from_wire` do the checking.

    Attributes:
        codec: one of ``CODECS``.
        numel: number of float values encoded.
        block_size: values per scale for int8/int4; carried but unused otherwise.
        payload: scales (float32 LE) followed by codes; see the module docstring.
            Any contiguous byte buffer (a view of a tensor, or of received bytes).
        k: values ``topk`` keeps per chunk (0 for other codecs).
        bits: bits per kept value of ``topk`` and ``sparse`` (0 for other codecs).
    """

    codec: str
    numel: int
    block_size: int
    payload: bytes | bytearray | memoryview
    k: int = 0
    bits: int = 0

    def meta(self) -> dict:
        """Everything but the payload, as ``{"c", "n", "b"}`` and, for sparse codecs,
        ``"k"`` and ``"q"`` (the payload travels raw)."""
        meta = {"c": self.codec, "n": self.numel, "b": self.block_size}
        if self.codec in SPARSE:
            meta.update(k=self.k, q=self.bits)
        return meta

    @classmethod
    def from_meta(
        cls, meta: object, payload: bytes | bytearray | memoryview, *, max_numel: int
    ) -> Encoded:
        """Parses :meth:`meta` fields from a peer next to their raw payload.

        Raises:
            CodecError: as :meth:`from_wire`.
        """
        if not isinstance(meta, dict) or not {"c", "n", "b"} <= set(meta):
            raise CodecError("malformed", "codec fields c, n, b missing")
        sparse = meta["c"] in SPARSE
        if sparse and not {"k", "q"} <= set(meta):
            raise CodecError("malformed", "sparse codec fields k, q missing")
        enc = cls(
            codec=meta["c"],
            numel=meta["n"],
            block_size=meta["b"],
            payload=payload,
            k=meta["k"] if sparse else 0,
            bits=meta["q"] if sparse else 0,
        )
        validate(enc, max_numel=max_numel)
        return enc

    def to_wire(self) -> dict:
        """Returns a plain msgpack-able dict: :meth:`meta` and ``"p"``, the payload."""
        return {**self.meta(), "p": self.payload}

    @classmethod
    def from_wire(cls, d: object, *, max_numel: int) -> Encoded:
        """Parses and validates a wire dict from a peer.

        Args:
            d: the decoded msgpack object.
            max_numel: the largest tensor the caller is willing to accept.

        Returns:
            The validated ``Encoded``; its payload length is already checked.

        Raises:
            CodecError: on a non-dict, missing or extra keys, a wrong type, an
                unknown codec, a numel outside ``[0, max_numel]``, a block size
                outside ``[1, 2**20]`` or a payload of the wrong length.
        """
        if not isinstance(d, dict):
            raise CodecError("malformed", f"expected a dict, got {type(d).__name__}")
        want = _SPARSE_KEYS if d.get("c") in SPARSE else _WIRE_KEYS
        if set(d) != want:
            keys = short(sorted(repr(k) for k in d))
            raise CodecError("malformed", f"expected keys {', '.join(sorted(want))}; got {keys}")
        return cls.from_meta(d, d["p"], max_numel=max_numel)
