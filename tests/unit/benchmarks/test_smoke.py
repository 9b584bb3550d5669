"""Smoke runs of the benchmarks that start no process, and the ``--smoke`` flag itself.

A smoke run (``run(Mode(smoke=True), ...)``, ``python -m benchmarks NAME --smoke``) goes
through a benchmark's whole code path at the smallest sizes; it must report no failed
measurement, render in the docs' tables, and never write into ``benchmarks/results``.
The benchmarks that start nodes or ranks are smoked in
``tests/integration/test_benchmark_smoke.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest

from benchmarks import __main__ as bench_cli
from benchmarks import churn, codec, relay, tables
from benchmarks._mode import Mode

# benchmark -> where its smoke test lives: every registered benchmark has one
SMOKED_HERE = {"codec", "churn", "relay"}


def _results_stamps() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in tables.RESULTS.rglob("*") if p.is_file()}


def check_smoke_report(name: str, report: dict, out: Path) -> None:
    """What every smoke run must give: no failed measurement, its own JSON in ``out``
    with ``smoke`` set, and rows for the docs' tables where the benchmark has them."""
    assert bench_cli.failures(report) == [], bench_cli.failures(report)
    assert report["benchmark"] == name and report["smoke"] is True
    written = json.loads((out / f"{name}.json").read_text())
    assert written["smoke"] is True
    if name in tables.ROW_BUILDERS:
        (path,) = [p for p in tables.results_files(out) if p.name == f"{name}.json"]
        rows = tables.rows_of(path, out)
        assert rows and all(r.what and r.result for r in rows)
        assert rows[0].command.startswith(f"python -m benchmarks {name}")
        assert "--smoke" in rows[0].command


def test_the_codec_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    before = _results_stamps()
    report = codec.run(Mode(smoke=True), tmp_path)
    check_smoke_report("codec", report, tmp_path)
    assert report["numel"] == 20_000
    assert (tmp_path / "codec.png").is_file()
    assert _results_stamps() == before


def test_the_relay_benchmark_at_smoke_size_lists_its_rows_as_not_run(tmp_path: Path) -> None:
    report = relay.run(Mode(smoke=True), tmp_path)
    check_smoke_report("relay", report, tmp_path)
    assert report["rows"] == {} and set(report["rows_not_run"]) == {"direct", "relay"}
    assert (tmp_path / "relay.png").is_file()


def test_the_churn_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    report = churn.run(Mode(smoke=True), tmp_path)
    check_smoke_report("churn", report, tmp_path)
    assert {(r["trigger"], r["churn"]) for r in report["rows"]} == {
        (t, c) for t in ("steps", "seconds") for c in (0.0, 0.05)
    }
    calm = [r for r in report["rows"] if r["churn"] == 0.0]
    assert all(r["reach"] == 1.0 and r["included"] == 1.0 and r["left"] == 0 for r in calm)
    assert set(report["goals"]) == {"steps n=64", "seconds n=64"}
    assert "| seconds | 64 | 5.0 % |" in churn.table(report)
    assert (tmp_path / "churn.png").is_file()


def test_every_benchmark_takes_smoke_and_has_a_smoke_test() -> None:
    from tests.integration import test_benchmark_smoke

    for name, module_name in bench_cli.BENCHMARKS.items():
        run = inspect.signature(importlib.import_module(module_name).run)
        assert list(run.parameters) == ["mode", "out_dir"], name  # smoke is the mode's
    assert set(bench_cli.BENCHMARKS) == SMOKED_HERE | test_benchmark_smoke.SMOKED


def test_cli_smoke_runs_the_benchmark_small_and_writes_where_told(tmp_path: Path, capsys) -> None:
    assert bench_cli.main(["codec", "--smoke", "--out", str(tmp_path)]) == 0
    assert "codec: done" in capsys.readouterr().out
    assert json.loads((tmp_path / "codec.json").read_text())["numel"] == 20_000


def test_cli_smoke_never_writes_into_the_results_folder(tmp_path: Path, capsys) -> None:
    before = _results_stamps()
    for out in ("benchmarks/results", str(tables.RESULTS), str(tables.RESULTS / "wan-netns")):
        assert bench_cli.main(["codec", "--smoke", "--out", out]) == 2
        assert "--smoke never writes to benchmarks/results" in capsys.readouterr().err
    assert bench_cli.main(["codec", "--smoke"]) == 0  # no --out: a new temporary folder
    err = capsys.readouterr().err
    out = Path(err.split("smoke results go to ", 1)[1].split()[0])
    try:
        assert (out / "codec.json").is_file() and not out.is_relative_to(tables.RESULTS)
    finally:
        for path in out.iterdir():
            path.unlink()
        out.rmdir()
    assert _results_stamps() == before


def test_the_partitions_benchmark_finds_the_flapping_run_it_repeats() -> None:
    # its smoke run needs a network lab and minutes (make test-all); what it imports
    # from the integration test is checked here
    from tests.integration import test_partitions

    assert {"lab", "root", "offsets"} <= set(inspect.signature(test_partitions.flap_run).parameters)
    assert callable(test_partitions.judge)
    assert test_partitions.FLAP_SECONDS > 0 and test_partitions.OFFSETS


@pytest.mark.parametrize("flag", ["--steps", "--long", "--netns"])
def test_cli_flags_still_apply_to_their_benchmarks_only(flag: str, capsys) -> None:
    argv = ["codec", flag, *(["10"] if flag == "--steps" else []), "--smoke"]
    assert bench_cli.main(argv) == 2
    assert f"{flag} applies to" in capsys.readouterr().err
