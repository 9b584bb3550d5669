"""Tests for benchmarks.robustness that start no node: the grid per codec, the topk
overrides the config must accept, and the report and heat map from stand-in swarms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _robustness_swarm, robustness, tables
from benchmarks._mode import Mode
from node.config import load_config
from verification.aggregators import SPARSE_SAFE


def _labels(block: robustness._Block) -> list[str]:
    return [a.label for a in block.aggregators]


def test_quick_keeps_the_int8_grid_and_adds_topk_under_the_aggregators_it_accepts() -> None:
    (setting,), (int8, topk) = robustness._grid(quick=True, smoke=False)
    assert (setting.nodes, setting.byzantine) == (5, 1)
    assert int8.codec == "int8" and int8.modes == ("scale", "alie", "malicious_owner")
    assert _labels(int8) == ["mean-unscreened", "trimmed_mean", "centered_clip"]
    assert int8.skipped == {}
    assert topk.codec == "topk" and topk.modes == int8.modes
    assert _labels(topk) == ["mean-unscreened", "centered_clip", "clipped_mean"]
    assert list(topk.skipped) == ["trimmed_mean"]
    assert "cannot work with sync.codec = 'topk'" in topk.skipped["trimmed_mean"]


def test_full_runs_topk_under_every_sparse_safe_aggregator_and_lists_the_rest() -> None:
    settings, (int8, topk) = robustness._grid(quick=False, smoke=False)
    assert [s.key for s in settings] == ["1_of_5", "2_of_8"]
    assert len(int8.aggregators) == len(robustness._AGGREGATORS) and not int8.skipped
    assert {a.name for a in topk.aggregators} == SPARSE_SAFE
    assert set(topk.skipped) == {"median", "trimmed_mean"}


def test_smoke_is_one_int8_cell() -> None:
    (setting,), (block,) = robustness._grid(quick=False, smoke=True)
    assert (setting.nodes, block.codec, block.modes) == (2, "int8", ("scale",))
    assert _labels(block) == ["trimmed_mean"]


def test_topk_overrides_keep_eight_values_of_every_chunk_in_two_bits() -> None:
    cfg = load_config(None, [*_robustness_swarm.SMALL, *_robustness_swarm.CODECS["topk"]])
    assert cfg.sync.codec == "topk"
    assert cfg.sync.codec_args() == {"block_size": 256, "k": 8, "bits": 2}


def _stand_in(
    setting: robustness._Setting,
    block: robustness._Block,
    agg: robustness._Aggregator,
    mode: str | None,
    base: Path,
    index: int,
) -> dict[str, Any]:
    # a clean run ends at 2.0; an attack costs 10 % under topk, 5 % under int8
    cost = {"topk": 1.1, "int8": 1.05}[block.codec] if mode else 1.0
    return {
        **robustness._record_head(setting, block, agg, mode),
        "val_bpb_end": 2.0 * cost,
        "attacker_flagged_by": 4 if mode and agg.screening else 0,
        "honest_nodes": 4,
        "honest_flagged": 0,
        "seconds": 0.0,
    }


def test_quick_report_carries_codecs_skips_and_ratios_and_renders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(robustness, "_run_swarm", _stand_in)
    report = robustness.run(Mode(quick=True), tmp_path)
    cells = report["cells"]
    assert len(cells) == 18
    topk = [c for c in cells if c["codec"] == "topk"]
    assert {c["aggregator"] for c in topk} == {"mean-unscreened", "centered_clip", "clipped_mean"}
    assert all(c["ratio_to_clean"] == pytest.approx(1.1) for c in topk)
    assert all(c["ratio_to_clean"] == pytest.approx(1.05) for c in cells if c["codec"] == "int8")
    clean = report["clean"]["1_of_5"]
    assert set(clean) == {
        "mean-unscreened",
        "trimmed_mean",
        "centered_clip",
        "topk/mean-unscreened",
        "topk/centered_clip",
        "topk/clipped_mean",
    }
    assert [b["codec"] for b in report["blocks"]] == ["int8", "topk"]
    assert list(report["blocks"][1]["skipped"]) == ["trimmed_mean"]
    assert json.loads((tmp_path / "robustness.json").read_text()) == report
    assert (tmp_path / "robustness.png").stat().st_size > 0
    (path,) = [p for p in tables.results_files(tmp_path) if p.name == "robustness.json"]
    assert tables.rows_of(path, tmp_path)
