"""Robustness benchmark: what a Byzantine node does to the honest nodes' validation loss.

Every cell is a real swarm of node processes on 127.0.0.1 (``node.ops.swarm``), with the
small, fast model of the integration tests, 3 outer rounds, one group holding every
node, and the last node(s) started with ``--byzantine MODE``. Each fault mode is run
under plain mean without screening (the undefended baseline) and under each robust
aggregator with screening on; a clean run per aggregator gives the reference, so a
cell's headline is ``val_bpb_end / clean val_bpb_end`` of the same aggregator (1.0:
the attack cost nothing). Clean runs also count honest peers flagged by honest ones,
which should be zero: a defence that quarantines honest peers is not a defence.

The grid has one block per codec: ``int8``, and ``topk`` (sparse pseudo-gradients, 8
values of every chunk of 256 in 2 bits: the tiny model's size) under the aggregators the
config accepts with it (``verification.aggregators.SPARSE_SAFE``); the report lists the
refused ones with the config's reason. Swarms run one after another, each in a fresh
directory, and are always stopped; :func:`run` says what the quick, full and smoke
(``--smoke``) modes run. ``python -m benchmarks robustness [--quick]`` writes
``robustness.json`` and ``.png``; ``--checks`` runs the useful-work checks' mode
instead (:mod:`benchmarks._robustness_checks`).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks import _robustness_checks
from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from benchmarks._robustness_swarm import (
    CODECS,
    SMALL,
    judge,
    launch_and_wait,
    ratio,
)
from node.config import ConfigError, load_config
from node.ops import swarm
from node.swarm.byzantine import MODES

__all__ = ["run"]

_ROUNDS = 3
_SMOKE_ROUNDS = 1
# Rounds of a few steps, so that a smoke run's swarm ends within seconds of its start.
_SMOKE = [
    "sync.trigger='steps'",
    "sync.inner_steps=2",
    "network.matchmaking_seconds=2",
    "network.round_timeout=6",
]
# A swarm with a quarantined node waits out deadlines; twice the slowest seen is ample.
_SWARM_TIMEOUT = {2: 180.0, 5: 300.0, 8: 600.0}
_COLOR_CAP = 2.0


@dataclass(frozen=True)
class _Aggregator:
    """One column of the grid: a trust policy's aggregator and whether it screens."""

    label: str
    name: str
    screening: bool
    needs_f: bool = False  # Krum's f is set to the number of Byzantine nodes

    def params(self, byzantine: int) -> dict[str, int]:
        return {"f": byzantine} if self.needs_f else {}

    def overrides(self, byzantine: int) -> list[str]:
        params = ", ".join(f"{k} = {v}" for k, v in self.params(byzantine).items())
        return [
            f"trust.aggregator='{self.name}'",
            f"trust.aggregator_params={{{params}}}",
            f"trust.screening={'true' if self.screening else 'false'}",
        ]


_AGGREGATORS = (
    _Aggregator("mean-unscreened", "mean", screening=False),
    _Aggregator("median", "median", screening=True),
    _Aggregator("trimmed_mean", "trimmed_mean", screening=True),
    _Aggregator("centered_clip", "centered_clip", screening=True),
    _Aggregator("clipped_mean", "clipped_mean", screening=True),
    _Aggregator("krum", "krum", screening=True, needs_f=True),
    _Aggregator("multi_krum", "multi_krum", screening=True, needs_f=True),
)
# Quick mode: a magnitude attack, one screens cannot see, and an owner-side one, against
# the undefended mean and two robust aggregators (9 attacked swarms + 3 clean; a swarm of
# 5 takes about 2 minutes here, 3 rounds of 30 s plus starting and stopping the nodes).
_QUICK_MODES = ("scale", "alie", "malicious_owner")
_QUICK_AGGREGATORS = ("mean-unscreened", "trimmed_mean", "centered_clip")
# topk tries the same columns plus the norm-clipped mean; the config refuses trimmed_mean
# with topk, which leaves three (9 attacked swarms + 3 clean more).
_QUICK_TOPK_AGGREGATORS = (*_QUICK_AGGREGATORS, "clipped_mean")


@dataclass(frozen=True)
class _Block:
    """A codec's part of the grid: attacks, aggregators accepted, those refused (label -> why)."""

    codec: str
    modes: tuple[str, ...]
    aggregators: tuple[_Aggregator, ...]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def overrides(self) -> tuple[str, ...]:
        return CODECS[self.codec]


def _block(codec: str, modes: tuple[str, ...], labels: tuple[str, ...] | None) -> _Block:
    """The block of ``codec`` over the aggregators ``labels`` (None: all) it accepts."""
    accepted, skipped = [], {}
    for agg in _AGGREGATORS:
        if labels is not None and agg.label not in labels:
            continue
        # the config decides, so the grid never starts a swarm every node would refuse
        try:
            load_config(None, [*SMALL, *CODECS[codec], *agg.overrides(1)])
        except ConfigError as e:
            skipped[agg.label] = str(e)
            continue
        accepted.append(agg)
    return _Block(codec, modes, tuple(accepted), skipped)


@dataclass
class _Setting:
    """How many nodes, and how many of them are Byzantine."""

    nodes: int
    byzantine: int
    rounds: int = _ROUNDS
    extra: tuple[str, ...] = ()  # overrides after the workload's
    clean: dict[str, dict] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.byzantine}_of_{self.nodes}"

    @property
    def byzantine_indices(self) -> list[int]:
        return list(range(self.nodes - self.byzantine, self.nodes))


# ---- one swarm ------------------------------------------------------------------------


def _record_head(
    setting: _Setting, block: _Block, agg: _Aggregator, mode: str | None
) -> dict[str, Any]:
    """A swarm's record before it runs: mode, codec, aggregator, how many are Byzantine."""
    return {
        "mode": mode or "clean",
        "codec": block.codec,
        "aggregator": agg.label,
        "aggregator_params": agg.params(setting.byzantine),
        "screening": agg.screening,
        "nodes": setting.nodes,
        "byzantine": len(setting.byzantine_indices) if mode else 0,
    }


def _run_swarm(
    setting: _Setting,
    block: _Block,
    agg: _Aggregator,
    mode: str | None,
    base: pathlib.Path,
    index: int,
) -> dict[str, Any]:
    """One swarm: ``mode`` on the Byzantine nodes (None: a clean run)."""
    overrides = [
        *SMALL,
        *setting.extra,
        *block.overrides,
        f"network.group_size={setting.nodes}",
        *agg.overrides(setting.byzantine),
    ]
    byzantine = setting.byzantine_indices if mode else []
    directory = base / f"swarm{index:03d}"
    spec = swarm.SwarmSpec(
        nodes=setting.nodes,
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=setting.rounds,
        extra_args={i: ["--byzantine", mode] for i in byzantine},
    )
    record = _record_head(setting, block, agg, mode)
    started = time.monotonic()
    try:
        nodes, finished = launch_and_wait(spec, _SWARM_TIMEOUT.get(setting.nodes, 600.0))
        summary = swarm.summarize(nodes, load_config(None, overrides), byzantine)
        record.update(judge(summary, byzantine))
        # the directory goes before the next swarm, so keep why a node failed
        if summary["failed_nodes"]:
            record["failed_nodes"] = summary["failed_nodes"]
        if not finished:
            record["error"] = "timed out; stopped before every node finished"
    except Exception as e:  # one broken cell must not cost the whole grid
        record.update(error=f"{type(e).__name__}: {e}", val_bpb_end=None, params_agree=False)
    finally:
        record["seconds"] = round(time.monotonic() - started, 1)
        shutil.rmtree(directory, ignore_errors=True)
    return record


# ---- the grid -------------------------------------------------------------------------


def _grid(quick: bool, smoke: bool) -> tuple[list[_Setting], list[_Block]]:
    if smoke:
        return [_Setting(2, 1, _SMOKE_ROUNDS, tuple(_SMOKE))], [
            _block("int8", ("scale",), ("trimmed_mean",))
        ]
    if quick:
        return [_Setting(5, 1)], [
            _block("int8", _QUICK_MODES, _QUICK_AGGREGATORS),
            _block("topk", _QUICK_MODES, _QUICK_TOPK_AGGREGATORS),
        ]
    return [_Setting(5, 1), _Setting(8, 2)], [_block(codec, MODES, None) for codec in CODECS]


def _clean_key(codec: str, label: str) -> str:
    # int8 keeps the bare label, as in reports from before the codec blocks
    return label if codec == "int8" else f"{codec}/{label}"


def _progress(done: int, total: int, record: dict[str, Any]) -> None:
    # A full run takes hours: say where it is on stderr, the JSON stays the record.
    bpb = record.get("val_bpb_end")
    print(
        f"robustness {done}/{total}: {record['byzantine']} of {record['nodes']} "
        f"{record['codec']:>4} {record['mode']:>15} {record['aggregator']:>15}  "
        f"val_bpb_end {f'{bpb:.3f}' if bpb is not None else 'n/a'}  "
        f"flagged_by {record.get('attacker_flagged_by', '-')}  {record['seconds']:.0f}s"
        + (f"  ERROR {record['error']}" if record.get("error") else ""),
        file=sys.stderr,
        flush=True,
    )


def _run_grid(settings: list[_Setting], blocks: list[_Block], base: pathlib.Path) -> list[dict]:
    """Every block's clean and attacked swarms, per setting; returns the attacked cells."""
    total = len(settings) * sum(len(b.aggregators) * (len(b.modes) + 1) for b in blocks)
    cells: list[dict[str, Any]] = []
    done = 0
    for setting in settings:
        for block in blocks:
            for agg in block.aggregators:
                record = _run_swarm(setting, block, agg, None, base, done)
                setting.clean[_clean_key(block.codec, agg.label)] = record
                done += 1
                _progress(done, total, record)
                for mode in block.modes:
                    cell = _run_swarm(setting, block, agg, mode, base, done)
                    cell["setting"] = setting.key
                    cell["ratio_to_clean"] = ratio(cell, record)
                    cells.append(cell)
                    done += 1
                    _progress(done, total, cell)
    return cells


# ---- report ---------------------------------------------------------------------------


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    """One heat map per codec block (rows) and setting (columns)."""
    settings, blocks = report["settings"], report["blocks"]
    width = max(7.0, 2.5 + 1.3 * max(len(b["aggregators"]) for b in blocks))
    height = max(3.8, 2.2 + 0.5 * max(len(b["modes"]) for b in blocks))
    size = (width * len(settings), height * len(blocks))
    with figure(path, len(blocks), len(settings), figsize=size, squeeze=False) as (fig, axes):
        for row, block in zip(axes, blocks):
            for ax, key in zip(row, settings):
                codec = block["codec"]
                cells = [c for c in report["cells"] if (c["setting"], c["codec"]) == (key, codec)]
                _heat_map(fig, ax, cells, block["modes"], block["aggregators"])
                byzantine, nodes = key.split("_of_")
                rounds = report["rounds"]
                ax.set_title(f"{codec}: {byzantine} Byzantine of {nodes} nodes, {rounds} rounds",
                             fontsize=10)  # fmt: skip
        fig.suptitle(
            "Final honest validation bits/byte under attack / clean run of the same aggregator"
            " and codec",
            fontsize=10,
        )


def _heat_map(fig: Any, ax: Any, cells: list[dict], modes: list[str], labels: list[str]) -> None:
    """Modes x aggregators, coloured by the ratio to clean, annotated with it and the flags."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    grid = np.full((len(modes), len(labels)), np.nan)
    for c in cells:
        if c.get("ratio_to_clean") is not None:
            grid[modes.index(c["mode"]), labels.index(c["aggregator"])] = c["ratio_to_clean"]
    finite = grid[np.isfinite(grid)]
    # Centred on 1.0 (the attack cost nothing). A wrecked model reaches ratios of 100 and
    # more; colours saturate at _COLOR_CAP so a 5 % effect still shows, and the text
    # carries the value.
    top = min(_COLOR_CAP, max(1.1, float(finite.max()) if finite.size else 1.1))
    bottom = min(1.0 / top, float(finite.min()) if finite.size else 1.0, 0.95)
    norm = TwoSlopeNorm(vmin=bottom, vcenter=1.0, vmax=top)
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", norm=norm, aspect="auto")
    ax.set_facecolor("lightgray")  # cells without a result
    for c in cells:
        row, col = modes.index(c["mode"]), labels.index(c["aggregator"])
        value = c.get("ratio_to_clean")
        text = "n/a" if value is None else f"{value:.3g}"
        if c.get("honest_nodes"):
            text += f"\nflagged by {c.get('attacker_flagged_by', 0)}/{c['honest_nodes']}"
        shade = float(norm(value)) if value is not None else 0.5
        color = "white" if abs(shade - 0.5) > 0.35 else "black"  # legible on dark cells
        ax.text(col, row, text, ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(modes)), modes, fontsize=8)
    fig.colorbar(image, ax=ax, label="val bpb / clean", extend="max")


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Runs the attack grid with real node swarms and writes the report and heat map.

    Args:
        mode: what it runs: ``quick``: 1 of 5 nodes Byzantine, modes scale, alie and
            malicious_owner; with int8 under mean-unscreened, trimmed_mean and
            centered_clip, with topk under mean-unscreened, centered_clip and clipped_mean
            (24 swarms, about 50 minutes here); otherwise every mode under every aggregator
            each codec accepts, for 1 of 5 and 2 of 8 Byzantine nodes (hours); ``smoke``:
            one clean and one attacked int8 swarm of 2 nodes (``scale``, trimmed mean with
            screening) for 1 round of 2 inner steps: a check that it runs; ``checks``: the
            useful-work checks' mode instead (its own quick, full and smoke).
        out_dir: folder for ``robustness.json`` and ``robustness.png``; created if missing.

    Returns:
        The dict written to ``robustness.json``: ``cells`` (one per attacked swarm:
        mode, codec, aggregator, screening, val_bpb_end, ratio_to_clean, params_agree,
        attacker_flagged_by, honest_flagged, ...), ``blocks`` (per codec: overrides,
        modes, aggregators run and ``skipped``, the aggregators the config refuses with
        that codec and its message), ``clean`` (per setting, the clean run of each
        aggregator, keyed ``label`` for int8 and ``codec/label`` otherwise),
        ``clean_honest_flagged`` (honest peers flagged in all clean runs together;
        should be 0), ``quick``, ``date`` and ``machine``.
    """
    if mode.checks:
        return _robustness_checks.run(mode, out_dir)
    settings, blocks = _grid(mode.quick, mode.smoke)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-robustness-") as tmp:
        cells = _run_grid(settings, blocks, pathlib.Path(tmp))
    report = _report(settings, blocks, cells, mode.quick, mode.smoke)
    report["seconds"] = round(time.monotonic() - started, 1)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "robustness.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "robustness.png")
    return report


def _report(
    settings: list[_Setting], blocks: list[_Block], cells: list[dict], quick: bool, smoke: bool
) -> dict[str, Any]:
    labels = [a.label for b in blocks for a in b.aggregators]
    return {
        "benchmark": "robustness",
        "quick": quick,
        "smoke": smoke,
        "rounds": settings[0].rounds,
        "settings": [s.key for s in settings],
        "modes": list(dict.fromkeys(m for b in blocks for m in b.modes)),
        "aggregators": list(dict.fromkeys(labels)),
        "blocks": [
            {
                "codec": b.codec,
                "overrides": list(b.overrides),
                "modes": list(b.modes),
                "aggregators": [a.label for a in b.aggregators],
                "skipped": b.skipped,
            }
            for b in blocks
        ],
        "cells": cells,
        "clean": {s.key: s.clean for s in settings},
        "clean_honest_flagged": sum(
            c.get("honest_flagged", 0) for s in settings for c in s.clean.values()
        ),
        "notes": _NOTES,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }


_NOTES = {
    "workload": "the integration tests' small model and data: 1-layer byte-level "
    f"GPT, 64-dim, context 64, 2 fragments, {_ROUNDS} wall-clock rounds of 30 s "
    "(sync.trigger = seconds, the default); one group holds every node "
    "(network.group_size = nodes)",
    "codec": "int8: blockwise absmax in 8 bits; topk: 8 values of every chunk of 256 "
    "(topk_density 0.03) in 2 bits, owners answer with the union in 8 bits; each "
    "block's overrides are in blocks[].overrides",
    "skipped": "aggregators a codec's block leaves out because the config refuses "
    "them with that codec (median and trimmed_mean are coordinate-wise: on sparse "
    "parts they drop almost every value), with the config's message",
    "val_bpb_end": "mean over honest nodes of the validation bits per byte at "
    "the last round every honest node reached",
    "ratio_to_clean": "val_bpb_end / val_bpb_end of the clean run with the same "
    "aggregator and codec; 1.0 means the attack cost nothing, above 1 it hurt",
    "attacker_flagged_by": "honest nodes whose trust store had a Byzantine node "
    "quarantined or banned at their last round",
    "honest_flagged": "distinct honest peers quarantined or banned by any honest node (target 0)",
    "mean-unscreened": "trust.aggregator = mean, trust.screening = false: the "
    "undefended baseline; signature, shape and finiteness checks still run",
    "krum": "Krum and Multi-Krum use f = the number of Byzantine nodes",
    "clipped_mean": "norm-clipped mean with its default tau = 1 (each input scaled to "
    "at most the median norm)",
}
