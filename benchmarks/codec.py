"""Codec benchmark: encode+decode throughput, compression and error of each pseudo-gradient codec.

Run it alone with ``python -m benchmarks.codec [--quick]``; it writes
``codec.json`` and ``codec.png`` into the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import time

import torch

from benchmarks._common import figure
from benchmarks._mode import Mode
from protocol.wire.codec import DENSE, decode, encode

__all__ = ["run"]

_BLOCK_SIZE = 256
_REPEATS = 3
_TOPK_CHUNK = 4096
# (label, codec, stochastic, codec arguments): every dense codec, stochastic rounding
# where it exists, and topk at the sync defaults (1 % of each chunk of 4096 in 2 bits) and
# at 3 % in 4 bits. A topk row's error is mostly what it leaves for error feedback.
_VARIANTS: list[tuple[str, str, bool, dict]] = [
    *((codec, codec, False, {"block_size": _BLOCK_SIZE}) for codec in DENSE),
    ("int8+sr", "int8", True, {"block_size": _BLOCK_SIZE}),
    ("int4+sr", "int4", True, {"block_size": _BLOCK_SIZE}),
    ("topk 1% 2b", "topk", False, {"block_size": _TOPK_CHUNK, "k": 41, "bits": 2}),
    ("topk 3% 4b", "topk", False, {"block_size": _TOPK_CHUNK, "k": 123, "bits": 4}),
]


def _measure(x: torch.Tensor, codec: str, stochastic: bool, args: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    best_total = best_enc = best_dec = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        enc = encode(x, codec, stochastic=stochastic, generator=g, **args)
        t1 = time.perf_counter()
        y = decode(enc, expected_numel=x.numel())
        t2 = time.perf_counter()
        best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
        best_total = min(best_total, t2 - t0)
    input_bytes = 4 * x.numel()
    std = x.std().item()
    # float64 keeps the error statistics themselves from adding rounding noise.
    err = (y.double() - x.double()).abs()
    return {
        "codec": codec,
        "stochastic": stochastic,
        "seconds": best_total,
        "encode_seconds": best_enc,
        "decode_seconds": best_dec,
        "throughput_mb_s": input_bytes / best_total / 1e6,
        "payload_bytes": len(enc.payload),
        "compression_ratio": input_bytes / len(enc.payload),
        "rel_rmse": err.pow(2).mean().sqrt().item() / std,
        "rel_max_abs_error": err.max().item() / std,
    }


def _plot(results: dict, n: int, path: pathlib.Path) -> None:
    labels = list(results)
    pos = list(range(len(labels)))
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, (ax_tp, ax_err)):
        ax_tp.bar(pos, [r["throughput_mb_s"] for r in results.values()], color="tab:blue")
        ax_tp.set_yscale("log")
        ax_tp.set_ylabel("encode+decode MB/s of float32 input")
        ax_tp.set_title(f"Throughput, {n / 1e6:g}M values (bar label: compression)")
        for i, r in enumerate(results.values()):
            ax_tp.annotate(
                f"{r['compression_ratio']:.1f}x",
                (i, r["throughput_mb_s"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )

        # A lossless codec has zero error, which a log axis cannot show; label it instead.
        rmse = [r["rel_rmse"] for r in results.values()]
        ax_err.bar(pos, [v if v > 0 else float("nan") for v in rmse], color="tab:orange")
        ax_err.set_yscale("log")
        ax_err.set_ylabel("RMSE / input std")
        ax_err.set_title(f"Relative RMSE (block size {_BLOCK_SIZE})")
        positive = [v for v in rmse if v > 0]
        floor = min(positive) / 3 if positive else 1e-6
        ax_err.set_ylim(bottom=floor)
        for i, v in enumerate(rmse):
            if v == 0:
                ax_err.annotate("exact", (i, floor), ha="center", va="bottom", fontsize=8)
        for ax in (ax_tp, ax_err):
            ax.set_xticks(pos, labels, rotation=30)
            ax.grid(axis="y", which="both", alpha=0.3)


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Benchmarks every codec on normal random float32 values.

    Args:
        mode: what it runs: ``quick``: use 2M values instead of 10M; ``smoke``: 20,000
            values: a check that it runs (``python -m benchmarks --smoke``).
        out_dir: folder for ``codec.json`` and ``codec.png``; created if missing.

    Returns:
        The dict written to ``codec.json``: per-variant results (best of 3
        encode+decode timings, throughput in MB/s of input, compression ratio,
        RMSE and max abs error relative to the input std) and the environment.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        n = 20_000 if mode.smoke else 2_000_000 if mode.quick else 10_000_000
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        results = {label: _measure(x, codec, sr, args) for label, codec, sr, args in _VARIANTS}
        report = {
            "benchmark": "codec",
            "quick": mode.quick,
            "smoke": mode.smoke,
            "numel": n,
            "block_size": _BLOCK_SIZE,
            "repeats": _REPEATS,
            "results": results,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "platform": platform.platform(),
                "machine": platform.machine(),
                "processor": platform.processor(),
                "python": platform.python_version(),
                "cpu_count": os.cpu_count(),
            },
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(threads_before)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "codec.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, n, out_dir / "codec.png")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2M values instead of 10M")
    args = parser.parse_args()
    out = pathlib.Path("benchmarks/results")
    summary = run(args.quick, out)
    for label, r in summary["results"].items():
        print(
            f"{label:8s} {r['throughput_mb_s']:8.0f} MB/s  {r['compression_ratio']:5.2f}x  "
            f"rmse/std {r['rel_rmse']:.2e}  max/std {r['rel_max_abs_error']:.2e}"
        )
    print(f"wrote {out / 'codec.json'} and {out / 'codec.png'}")
