"""The benchmark summary: a row with a command and a date for every results file."""

from __future__ import annotations

import json

import pytest

from benchmarks import tables

# every results file the docs' table shows, by its path under benchmarks/results/
FILES = [
    "allreduce.json",
    "allreduce-full/allreduce.json",
    "churn.json",
    "goodput.json",
    "codec.json",
    "convergence.json",
    "convergence-long.json",
    "convergence-sparse.json",
    "islands.json",
    "islands-quick/islands.json",
    "join.json",
    "relay.json",
    "mixing.json",
    "models.json",
    "partitions.json",
    "robustness.json",
    "robustness-checks.json",
    "scale.json",
    "sites.json",
    "sparse.json",
    "stragglers.json",
    "verification.json",
    "wan.json",
    "wan-netns/wan.json",
]


@pytest.mark.parametrize("name", FILES)
def test_every_results_file_yields_rows_with_a_command_and_a_date(name: str) -> None:
    rows = tables.rows_of(tables.RESULTS / name)
    assert rows
    for row in rows:
        assert row.what and row.result
        assert row.command.startswith("python -m benchmarks ")
        assert row.date[:4].isdigit() and "T" in row.date


def test_the_summary_covers_every_results_file() -> None:
    found = {p.relative_to(tables.RESULTS).as_posix() for p in tables.results_files()}
    assert found == set(FILES)
    assert len(tables.rows()) >= len(FILES)


def test_the_command_follows_the_files_flags_and_folder() -> None:
    commands = {
        name: tables.rows_of(tables.RESULTS / name)[0].command
        for name in ("allreduce.json", "allreduce-full/allreduce.json", "models.json")
    }
    commands["wan-netns/wan.json"] = tables.rows_of(tables.RESULTS / "wan-netns/wan.json")[
        0
    ].command
    assert commands == {
        "allreduce.json": "python -m benchmarks allreduce --quick",
        "allreduce-full/allreduce.json": (
            "python -m benchmarks allreduce --out benchmarks/results/allreduce-full"
        ),
        "models.json": "python -m benchmarks models",
        "wan-netns/wan.json": (
            "python -m benchmarks wan --quick --netns --out benchmarks/results/wan-netns"
        ),
    }
    # a file that records its own command agrees with the one derived from it
    models = json.loads((tables.RESULTS / "models.json").read_text())
    assert models["command"] == commands["models.json"]


def test_a_figure_is_the_one_in_the_json() -> None:
    data = json.loads((tables.RESULTS / "stragglers.json").read_text())
    utilization = data["methods"]["atoll_seconds"]["utilization"]
    (row,) = tables.rows_of(tables.RESULTS / "stragglers.json")
    assert f"Atoll `seconds` **{utilization * 100:.1f} %**" in row.result
    assert row.date == data["date"]


def test_the_scale_tables_have_a_row_per_swarm_size() -> None:
    data = json.loads((tables.RESULTS / "scale.json").read_text())
    load = tables.scale_load_table(data).splitlines()
    simulated = tables.scale_simulated_table(data).splitlines()
    assert len(load) == 2 + len(data["load_table"])
    assert len(simulated) == 2 + len(data["simulated"]["node"])
