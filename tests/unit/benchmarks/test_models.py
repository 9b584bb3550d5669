"""The models benchmark: helper processes' CPU share and each node run against the bare run."""

from __future__ import annotations

import pytest


def test_the_models_benchmark_counts_helper_cpu_between_the_first_and_last_round():
    from benchmarks.models import _helper_share

    def event(t: float, p2pd: float, dht: float, control: float) -> dict:
        return {
            "t": t,
            "load": {"p2pd_cpu_s": p2pd, "dht": {"cpu_s": dht}, "control": {"cpu_s": control}},
        }

    rounds = [event(100.0, 1.0, 0.5, 2.0), event(130.0, 1.0, 0.5, 2.0), event(160.0, 1.6, 0.8, 2.9)]
    assert _helper_share(rounds) == pytest.approx((0.6 + 0.3 + 0.9) / 60.0)
    assert _helper_share(rounds[:1]) is None


def test_the_models_benchmark_compares_each_node_run_with_the_bare_run_beside_it():
    from benchmarks.models import _pair_ratios

    bare = [[100.0, 110.0], [200.0, 200.0]]
    nodes = [{"tokens_per_second": [105.0, 105.0]}, {"tokens_per_second": [190.0, None]}]
    assert _pair_ratios(bare, nodes) == pytest.approx([1.0, 0.95])
