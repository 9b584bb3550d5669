"""What a benchmark run is asked for: the :class:`Mode` that ``python -m benchmarks``
builds from its flags and every benchmark's ``run(mode, out_dir)`` reads, and which
benchmarks take which options of their own (:data:`OPTIONS`).

Every benchmark takes ``quick`` and ``smoke``; the others (``steps``, ``long``,
``sparse``, ``checks``, ``netns``) only the benchmarks that :data:`OPTIONS` names, and the
command line refuses them for any other (:func:`misused`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["OPTIONS", "Mode", "misused", "takers"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One run's mode.

    Attributes:
        quick: smaller sizes, fewer repeats.
        smoke: the smallest sizes that still go through the benchmark's code path: a
            check that it runs, not a measurement.
        steps: training steps per worker instead of the mode's default (convergence).
        long: the benchmark's long mode (convergence).
        sparse: only the topk rows, on the quick picks and DDP runs stored in the output
            folder (convergence).
        checks: the useful-work checks' swarms (robustness).
        netns: each worker in its own network namespace, links capped by tbf (wan).
    """

    quick: bool = False
    smoke: bool = False
    steps: int | None = None
    long: bool = False
    sparse: bool = False
    checks: bool = False
    netns: bool = False

    def own_options(self) -> list[str]:
        """The options beyond ``quick`` and ``smoke`` that this mode sets, in flag order."""
        return [
            name
            for name in _OWN
            if (getattr(self, name) is not None if name == "steps" else getattr(self, name))
        ]


_OWN = ("steps", "long", "sparse", "checks", "netns")
"""The options only some benchmarks take, in the order the command line checks them."""

OPTIONS: dict[str, frozenset[str]] = {
    "convergence": frozenset({"steps", "long", "sparse"}),
    "robustness": frozenset({"checks"}),
    "wan": frozenset({"netns"}),
}
"""Benchmark name -> the options of :data:`_OWN` its ``run`` reads from its mode (the
benchmarks taking ``steps`` also define ``steps_problem(steps) -> str | None``)."""


def takers(option: str) -> list[str]:
    """The benchmarks that take ``option``, sorted."""
    return sorted(name for name, own in OPTIONS.items() if option in own)


def misused(mode: Mode, names: Iterable[str], asked: str) -> str | None:
    """Why an option of ``mode`` does not apply to the benchmarks ``names`` (``asked``
    as the user named them), or None."""
    names = list(names)
    for option in mode.own_options():
        if not all(option in OPTIONS.get(name, ()) for name in names):
            return f"--{option} applies to {', '.join(takers(option))} only, not {asked}"
    return None
