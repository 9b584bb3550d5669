"""The all-reduce benchmark's codec rows: ``int8`` and ``topk`` parts over p2pd and the direct plane.

Each of these methods times, per repeat, the whole path a node pays for one exchange:
its vector encoded with the codec and decoded back to the dense vector a node's error
feedback hands the all-reduce (as ``node/run/syncer.py`` does), then
:meth:`~protocol.averaging.allreduce.AllReduceService.run` with the codec in its
settings (the service encodes the parts itself; owners answer ``topk`` parts with a
``sparse`` 8-bit result, ``int8`` parts with ``int8``), whose decode of the results is
part of the run. A peer checks its result against the mean of every peer's decoded
input: within half a quantization step of each chunk's absmax (``absmax / 254`` for
``int8``, ``absmax / 255`` for the 8-bit ``sparse`` result) and, for ``topk``, non-zero
exactly on the union of the inputs' supports.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from protocol.wire import codec as codecs

__all__ = [
    "CODEC_ARGS",
    "METHODS",
    "NOTES",
    "PLOT_BARS",
    "CodecPeer",
    "check",
    "expected",
    "ratios",
    "roundtrip",
    "settings_args",
    "verdict",
]

CODEC_ARGS: dict[str, dict[str, int]] = {
    "int8": {"block_size": 256},
    # a node's defaults: sync.topk_chunk 4096, sync.topk_density 0.01, sync.topk_bits 2
    "topk": {"block_size": 4096, "k": 41, "bits": 2},
}
"""The arguments of :func:`protocol.wire.codec.encode` for each codec row."""

METHODS: dict[str, tuple[str, str]] = {
    "int8_p2pd": ("int8", "p2pd"),
    "topk_p2pd": ("topk", "p2pd"),
    "int8_direct": ("int8", "tcp"),
    "topk_direct": ("topk", "tcp"),
}
"""Method -> (codec, transport data plane)."""

PLOT_BARS = [
    ("int8_p2pd", "int8 over p2pd", "tab:blue"),
    ("topk_p2pd", "topk (1 %, 2 bits) over p2pd", "tab:orange"),
    ("int8_direct", "int8, direct TCP plane", "tab:cyan"),
    ("topk_direct", "topk (1 %, 2 bits), direct TCP plane", "tab:red"),
]

NOTES = {
    "codec_rows": "int8_p2pd, topk_p2pd, int8_direct, topk_direct: per repeat, a peer "
    "encodes its vector (int8: block_size 256; topk: chunk 4096, k 41, 2 bits) and "
    "decodes it back, as a node hands the exchange its error-fed contribution, then "
    "runs AllReduceService.run with that codec over p2pd or the direct TCP plane "
    "(owners answer topk parts with a sparse 8-bit result); times include the encode "
    "(encode_times) and the decode of the results; correct: every chunk's error within "
    "half a result step of the chunk's absmax of the mean of the decoded inputs "
    "(error_bound_ratio <= 1) and, for topk, the result non-zero exactly on the union "
    "of the inputs' supports (support_ok); topk_vs_int8_<plane>: topk's median time "
    "over int8's, bytes_topk_vs_int8_<plane>: its bytes sent per peer over int8's",
}
"""The rows' entries in the notes of ``allreduce.json``."""

_RESULT_QMAX = {"int8": 127.0, "topk": 127.5}  # the owners' results: int8, and sparse in 8 bits
_SLACK = 1.001  # float32 rounding of the owner's mean against the float64 reference


def settings_args(codec: str) -> dict[str, Any]:
    """``AllReduceSettings`` keyword arguments for ``codec``'s parts."""
    args = CODEC_ARGS[codec]
    out: dict[str, Any] = {"codec": codec, "block_size": args["block_size"]}
    if codec == "topk":
        out.update(topk_k=args["k"], topk_bits=args["bits"])
    return out


def roundtrip(vector: torch.Tensor, codec: str) -> torch.Tensor:
    """``vector`` encoded with ``codec`` and decoded: what a node hands the exchange."""
    enc = codecs.encode(vector, codec, **CODEC_ARGS[codec])
    return codecs.decode(enc, expected_numel=vector.numel())


def expected(
    inputs: Iterable[torch.Tensor], codec: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean of the peers' decoded inputs, and (``topk``) the union of their supports."""
    total: torch.Tensor | None = None
    support: torch.Tensor | None = None
    count = 0
    for vector in inputs:
        decoded = roundtrip(vector, codec)
        if total is None:
            total = torch.zeros(decoded.numel(), dtype=torch.float64)
            support = torch.zeros(decoded.numel(), dtype=torch.bool) if codec == "topk" else None
        total += decoded
        if support is not None:
            support |= decoded != 0
        count += 1
    if total is None:
        raise ValueError("no inputs")
    return (total / count).float(), support


def _chunk_max(x: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.numel() % chunk)).view(-1, chunk).amax(1)


def check(
    result: torch.Tensor, reference: torch.Tensor, support: torch.Tensor | None, codec: str
) -> dict[str, Any]:
    """How far ``result`` is from ``reference`` for ``codec``'s results.

    Returns:
        ``bound_ratio``: the largest error of a chunk over its bound (half a result
        step of the reference's absmax in that chunk): at most 1 when correct;
        ``support_ok``: for ``topk``, whether the result is non-zero exactly where
        some input was (always True for ``int8``).
    """
    chunk = CODEC_ARGS[codec]["block_size"]
    errors = _chunk_max((result - reference).abs(), chunk)
    bounds = _chunk_max(reference.abs(), chunk) / (2 * _RESULT_QMAX[codec]) * _SLACK
    ratio = (errors / bounds.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    support_ok = support is None or torch.equal(result != 0, support)
    return {"bound_ratio": ratio, "support_ok": bool(support_ok)}


def verdict(timings: list[dict]) -> dict[str, Any]:
    """A method's correctness over every peer's :func:`check` of every repeat."""
    ratio = max(t["bound_ratio"] for t in timings)
    support = all(t["support_ok"] for t in timings)
    return {"error_bound_ratio": ratio, "support_ok": support, "correct": ratio <= 1 and support}


def ratios(results: dict) -> dict[str, dict[str, float | None]]:
    """topk's median time and bytes sent per peer over int8's, per data plane and size."""
    out: dict[str, dict[str, float | None]] = {}
    for plane in ("p2pd", "direct"):
        topk, int8 = results[f"topk_{plane}"], results[f"int8_{plane}"]
        for key, name in (
            ("median_s", "topk_vs_int8"),
            ("bytes_sent_per_peer", "bytes_topk_vs_int8"),
        ):
            out[f"{name}_{plane}"] = {
                n: topk[n][key] / r[key] if r.get(key) and topk.get(n, {}).get(key) else None
                for n, r in int8.items()
            }
    return out


class CodecPeer:
    """A peer of a codec row: ``exchange`` (the benchmark's Atoll peer, set up with
    :func:`settings_args`) runs the all-reduce of what this peer encodes and decodes.

    Args:
        exchange: has ``own``, ``info``, ``step(repeat, infos, vector)`` and ``close()``.
        codec: ``int8`` or ``topk``.
        inputs: every peer's raw vector, in peer order (for the expected result).
    """

    def __init__(self, exchange: Any, codec: str, inputs: Iterable[torch.Tensor]) -> None:
        self.exchange, self.codec = exchange, codec
        self.info = exchange.info
        self.reference, self.support = expected(inputs, codec)

    def step(self, repeat: int, infos: list[dict]) -> tuple[dict, torch.Tensor]:
        t0 = time.perf_counter()
        vector = roundtrip(self.exchange.own, self.codec)
        encode_s = time.perf_counter() - t0
        timing, result = self.exchange.step(repeat, infos, vector)
        timing.update(encode_s=encode_s, seconds=timing["seconds"] + encode_s)
        return timing, result

    def check(self, result: torch.Tensor) -> dict[str, Any]:
        return check(result, self.reference, self.support, self.codec)

    def close(self) -> None:
        self.exchange.close()
