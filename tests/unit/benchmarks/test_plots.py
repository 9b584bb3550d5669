"""Every benchmark's PNG can be drawn again from its stored results JSON (what
``benchmarks.tables`` and the docs read), through the one plot helper."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"

PLOTS = {
    "churn": ("benchmarks.churn", "_plot"),
    "islands": ("benchmarks.islands", "_plot"),
    "join": ("benchmarks.join", "_plot"),
    "mixing": ("benchmarks.mixing", "_plot"),
    "models": ("benchmarks.models", "_plot"),
    "partitions": ("benchmarks.partitions", "_plot"),
    "scale": ("benchmarks.scale", "_plot"),
    "sites": ("benchmarks.sites", "_plot"),
    "stragglers": ("benchmarks.stragglers", "_plot"),
    "robustness": ("benchmarks.robustness", "_plot"),
    "robustness-checks": ("benchmarks._robustness_checks_report", "plot"),
    "convergence-sparse": ("benchmarks.convergence", "_plot_sparse"),
}


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_a_stored_report_draws_again(name: str, tmp_path: Path) -> None:
    module, function = PLOTS[name]
    draw = getattr(importlib.import_module(module), function)
    out = tmp_path / f"{name}.png"
    draw(json.loads((RESULTS / f"{name}.json").read_text()), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
