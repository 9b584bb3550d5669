"""The docs site builds without a warning, and the README stays a front door."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 15_360  # bytes: hivemind's README is 13.6 KB


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (the dev extra installs them)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # the generated sections are there: a config key and a benchmark command
    configuration = (site / "configuration" / "index.html").read_text()
    assert "matchmaking_seconds" in configuration
    assert "config-reference" not in configuration
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "python -m benchmarks stragglers --quick" in benchmarks
    assert "benchmark-table" not in benchmarks


def test_the_readme_is_a_front_door() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; move the detail into docs/"


def test_the_architecture_page_names_every_product_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for package in ("node", "protocol", "verification")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py"
        and f"`{path.name}`" not in page
        and str(path.relative_to(ROOT)) not in page
    ]
    assert not missing, f"docs/architecture.md does not name {', '.join(missing)}"


def test_the_hop_table_names_real_files_and_calls() -> None:
    """Every row of the architecture page's hop table names two files that exist and a
    call that the second one defines, so the table cannot drift from the code."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 10
    for number, row in enumerate(rows, 1):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == str(number), f"hop {cells[0]} out of order"
        source, target = (f.strip().strip("`") for f in cells[1].split("→"))
        assert (ROOT / source).is_file() and (ROOT / target).is_file(), row
        text = (ROOT / target).read_text()
        *owner, name = cells[2].strip("`").split(".")
        assert f"def {name}(" in text, f"{target} defines no {name}"
        if owner:
            assert f"class {owner[0]}" in text, f"{target} defines no class {owner[0]}"
