"""Command line of the benchmarks: ``python -m benchmarks NAME|all [--quick] [--out DIR]``.

Each benchmark is a module with ``run(mode: Mode, out_dir: Path) -> dict`` that writes
its JSON and PNG files into ``out_dir``; register it in :data:`BENCHMARKS`. The flags
become one :class:`benchmarks._mode.Mode`. ``--smoke`` sets ``mode.smoke`` for every one:
the same code path at the smallest sizes that still go through it (2 nodes or peers, 1
or 2 short rounds, tiny tensors), so that a change that breaks a benchmark shows in
seconds rather than at its next real run; the figures mean nothing. ``make test`` runs
each one so (``tests/unit/benchmarks/test_smoke.py``,
``tests/integration/test_benchmark_smoke.py``) and asserts the report has no
:func:`failures` and renders in the docs' tables. Smoke results never go to
``benchmarks/results``: without ``--out`` they go to a new temporary folder, and
``--out benchmarks/results`` is refused. ``--steps N``, ``--long``, ``--sparse``,
``--checks`` and ``--netns`` set the mode's option of that name and are refused for a
benchmark that :data:`benchmarks._mode.OPTIONS` does not list as taking it; a benchmark
taking ``steps`` also defines ``steps_problem(steps) -> str | None``. A run may return
``{"skipped": reason}`` instead of its report, having written nothing. A run with a
failed measurement (:func:`failures`) is reported as failed, never as done.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import tempfile
import time
from typing import Any

from benchmarks._mode import Mode, misused, takers

__all__ = ["BENCHMARKS", "failures", "main"]

BENCHMARKS: dict[str, str] = {
    "codec": "benchmarks.codec",
    "allreduce": "benchmarks.allreduce",
    "robustness": "benchmarks.robustness",
    "verification": "benchmarks.verification",
    "stragglers": "benchmarks.stragglers",
    "convergence": "benchmarks.convergence",
    "wan": "benchmarks.wan",
    "mixing": "benchmarks.mixing",
    "sites": "benchmarks.sites",
    "scale": "benchmarks.scale",
    "cuda_site": "benchmarks.cuda_site",
    "models": "benchmarks.models",
    "partitions": "benchmarks.partitions",
    "join": "benchmarks.join",
    "churn": "benchmarks.churn",
    "goodput": "benchmarks.goodput",
    "islands": "benchmarks.islands",
    "sparse": "benchmarks.sparse",
    "gpu": "benchmarks.gpu",
    "relay": "benchmarks.relay",
}
"""Benchmark name -> module that defines ``run(mode, out_dir)``."""

_DEFAULT_OUT = pathlib.Path("benchmarks/results")
_RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _summary(name: str, report: dict, seconds: float) -> str:
    """One line: what ran, how long it took, and the headline numbers where known."""
    line = f"{name}: done in {seconds:.0f}s"
    headline = _HEADLINES.get(name)
    return line + headline(report, report.get("results", {})) if headline else line


def _allreduce_headline(report: dict, results: dict) -> str:
    parts = []
    for method, per_size in results.items():
        for n, r in per_size.items():
            value = f"{r['median_s']:.3f}s" if r.get("median_s") else "error"
            parts.append(f"{method}@{int(n) / 1e6:g}M {value}")
    ratios = report.get("ratios", {}).get("atoll_vs_hivemind", {})
    parts += [f"hivemind/atoll@{int(n) / 1e6:g}M {r:.2f}x" for n, r in ratios.items() if r]
    return " | " + ", ".join(parts)


def _codec_headline(report: dict, results: dict) -> str:
    best = max(results.items(), key=lambda kv: kv[1]["throughput_mb_s"], default=None)
    if not best:
        return ""
    return f" | {len(results)} variants, fastest {best[0]} {best[1]['throughput_mb_s']:.0f} MB/s"


def _wan_headline(report: dict, results: dict) -> str:
    parts = []
    for r in report.get("links", []):
        atoll, ddp = r["atoll"].get("utilization"), r["ddp"].get("utilization")
        if atoll is not None and ddp is not None:
            parts.append(f"{r['link']}: utilization Atoll {atoll:.0%}, DDP {ddp:.0%}")
    return " | " + "; ".join(parts)


def _sites_headline(report: dict, results: dict) -> str:
    parts = []
    for setup, r in report.get("setups", {}).items():
        if r.get("slow_link_bytes_per_round") is not None:
            parts.append(
                f"{setup}: {r['slow_link_bytes_per_round'] / 1e3:.0f} kB/round, "
                f"bits/byte {r.get('val_bpb_end') or float('nan'):.3f}"
            )
    parts.append(f"bytes ratio {report.get('bytes_ratio')}")
    return " | " + "; ".join(parts)


def _convergence_headline(report: dict, results: dict) -> str:
    parts = []
    for e in report.get("entries", []):
        gap = (e.get("gap_to_ddp_percent") or {}).get("mean")
        if gap is not None:
            parts.append(f"{e['label'].split(',')[0]} {gap:+.1f}%")
    return " | gap to DDP: " + "; ".join(parts)


def _models_headline(report: dict, results: dict) -> str:
    t, m = report.get("throughput", {}), report.get("memory", {})
    gap = report.get("convergence", {}).get("gap_percent_mean")
    return (
        f" | node/bare tokens/s {t.get('ratio') or float('nan'):.3f}; "
        f"{m.get('beyond_bytes_per_param') or float('nan'):.1f} B/param beyond a bare loop; "
        f"4 nodes vs DDP {gap if gap is not None else float('nan'):+.1f}%"
    )


def _mixing_headline(report: dict, results: dict) -> str:
    parts = []
    for n, r in results.items():
        d = r.get("derived") or {}
        if d.get("butterfly_full_mix_bytes") and d.get("allreduce_full_mix_bytes"):
            parts.append(
                f"n={n}: full mix butterfly {d['butterfly_full_mix_bytes'] / 1e3:.0f} kB "
                f"({d['rounds_to_mix_butterfly']} rounds), all-to-all "
                f"{d['all_to_all_full_mix_bytes'] / 1e3:.0f} kB, all-reduce "
                f"{d['allreduce_full_mix_bytes'] / 1e3:.0f} kB"
            )
        else:
            parts.append(f"n={n}: no result")
    return " | " + "; ".join(parts)


_HEADLINES = {
    "allreduce": _allreduce_headline,
    "codec": _codec_headline,
    "wan": _wan_headline,
    "sites": _sites_headline,
    "convergence": _convergence_headline,
    "models": _models_headline,
    "mixing": _mixing_headline,
}
"""Benchmark name -> the headline numbers its summary line adds (``report``, its
``results``)."""


def _written(out_dir: pathlib.Path, name: str, since: float) -> list[pathlib.Path]:
    # Modules name their files after themselves; only count what this run wrote.
    found = [*out_dir.glob(f"{name}.*"), *out_dir.glob(f"{name}-*.*")]  # and its modes
    return sorted(p for p in found if p.is_file() and p.stat().st_mtime >= since)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run benchmarks; each writes NAME.json and NAME.png into --out.",
    )
    parser.add_argument("name", help=f"one of {', '.join(BENCHMARKS)}, or all")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help=f"output folder (default {_DEFAULT_OUT}; with --smoke a new temporary folder)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest sizes that go through each benchmark's code path: a check "
        "that it runs, not a measurement",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps per worker, for {', '.join(takers('steps'))} only",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"the long mode, for {', '.join(takers('long'))} only",
    )
    parser.add_argument(
        "--sparse",
        action="store_true",
        help="only the topk rows, on the quick picks and DDP runs stored in --out, for "
        f"{', '.join(takers('sparse'))} only",
    )
    parser.add_argument(
        "--checks",
        action="store_true",
        help="the useful-work checks' swarms (rounds until a faulty node is flagged, their "
        f"cost), for {', '.join(takers('checks'))} only",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="each worker in its own network namespace, links capped by tbf (needs root), "
        f"for {', '.join(takers('netns'))} only",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the named benchmark (or every one) and prints a summary and the files written."""
    args = _parser().parse_args(argv)
    if args.name == "all":
        names = list(BENCHMARKS)
    elif args.name in BENCHMARKS:
        names = [args.name]
    else:
        known = ", ".join([*BENCHMARKS, "all"])
        print(f"unknown benchmark {args.name!r}: expected one of {known}", file=sys.stderr)
        return 2
    mode = Mode(
        quick=args.quick,
        smoke=args.smoke,
        steps=args.steps,
        long=args.long,
        sparse=args.sparse,
        checks=args.checks,
        netns=args.netns,
    )
    problem = misused(mode, names, args.name)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    out = _out_dir(args.out, mode.smoke)
    if out is None:
        print(f"--smoke never writes to {_DEFAULT_OUT}: give another --out", file=sys.stderr)
        return 2
    if mode.smoke:
        print(f"smoke results go to {out}", file=sys.stderr)
    failed = []
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        since = time.time() - 1.0  # file mtimes can lag the clock by a tick
        started = time.perf_counter()
        if mode.steps is not None:
            problem = module.steps_problem(mode.steps)
            if problem:
                print(f"{name}: {problem}", file=sys.stderr)
                return 2
        report = module.run(mode, out)
        if report.get("skipped"):
            print(f"{name}: skipped: {report['skipped']}", file=sys.stderr)
            continue
        line = _summary(name, report, time.perf_counter() - started)
        errors = failures(report)
        print(line.replace(": done in", ": FAILED after", 1) if errors else line)
        for path in _written(out, name, since):
            print(f"  wrote {path}")
        if errors:
            failed.append(name)
            print(f"{name}: {len(errors)} measurement(s) failed:", file=sys.stderr)
            for where, message in errors[:10]:
                print(f"  {where}: {message[:300]}", file=sys.stderr)
    if failed:
        print(f"FAILED: {', '.join(failed)} (see above)", file=sys.stderr)
        return 1
    return 0


def _out_dir(out: pathlib.Path | None, smoke: bool) -> pathlib.Path | None:
    """Where a run writes: ``out``, else the results folder or, for a smoke run, a new
    temporary folder; None for a smoke run aimed into the results folder."""
    if not smoke:
        return out or _DEFAULT_OUT
    if out is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="atoll-smoke-"))
    if out.resolve().is_relative_to(_RESULTS):
        return None
    return out


def failures(report: Any, where: str = "") -> list[tuple[str, str]]:
    """Every measurement of ``report`` that failed: ``(path, message)`` for each
    ``"error"`` key holding a message (a number under that name is a measured error)."""
    out: list[tuple[str, str]] = []
    if isinstance(report, dict):
        for key, value in report.items():
            if key == "error" and isinstance(value, str):
                out.append((where or "/", value))
            elif key == "errors" and isinstance(value, dict) and value:
                out += [(f"{where}/errors/{k}", str(v)) for k, v in value.items()]
            else:
                out += failures(value, f"{where}/{key}")
    elif isinstance(report, list):
        for i, value in enumerate(report):
            out += failures(value, f"{where}[{i}]")
    return out


if __name__ == "__main__":
    from node.ops.swarm import interrupt_on_sigterm

    interrupt_on_sigterm()  # a killed run stops the swarms it started
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("benchmarks: interrupted", file=sys.stderr)
        sys.exit(130)
