"""``python -m benchmarks``: which benchmarks it runs, what it refuses, when a run failed."""

from __future__ import annotations

from benchmarks import __main__ as bench_cli


def test_cli_refuses_an_unknown_benchmark(capsys):
    assert bench_cli.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_every_registered_benchmark_imports_and_has_run():
    import importlib

    for name, module_name in bench_cli.BENCHMARKS.items():
        module = importlib.import_module(module_name)
        assert callable(module.run), name


def test_cli_steps_applies_only_where_a_benchmark_takes_it(capsys, tmp_path):
    assert bench_cli.main(["codec", "--steps", "500", "--out", str(tmp_path)]) == 2
    assert "--steps applies to convergence only" in capsys.readouterr().err
    assert bench_cli.main(["convergence", "--steps", "120", "--out", str(tmp_path)]) == 2
    assert "expected a positive multiple of 50, 100, 250" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything ran or was written


def test_a_failed_measurement_fails_the_run_and_a_measured_error_does_not():
    report = {
        "cells": [{"median_s": 0.5}, {"error": "TypeError: reduce() got an unexpected keyword"}],
        "calibration": {"sizes": {"4": {"error": -0.012}}},
        "errors": {"seed 1": "rank 0 reported nothing"},
    }
    found = bench_cli.failures(report)
    assert ("/cells[1]", "TypeError: reduce() got an unexpected keyword") in found
    assert ("/errors/seed 1", "rank 0 reported nothing") in found
    assert len(found) == 2
    assert bench_cli.failures({"calibration": {"error": 0.1}, "errors": {}}) == []


def test_a_mode_option_applies_only_to_the_benchmarks_that_take_it():
    from benchmarks._mode import Mode, misused

    assert Mode(quick=True, smoke=True).own_options() == []
    assert Mode(steps=0, netns=True, long=True).own_options() == ["steps", "long", "netns"]
    assert misused(Mode(steps=500, long=True, sparse=True), ["convergence"], "convergence") is None
    assert misused(Mode(checks=True), ["robustness"], "robustness") is None
    assert misused(Mode(netns=True), ["wan", "codec"], "all") == (
        "--netns applies to wan only, not all"
    )
    assert misused(Mode(quick=True, smoke=True), ["codec", "wan"], "all") is None
