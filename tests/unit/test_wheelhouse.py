"""The GPU study's way onto a bare machine: the wheelhouse's parts and the launcher's
refusals (the install and the study themselves run in
``tests/integration/test_benchmark_smoke.py`` and on a lent GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "dev/wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheels_are_shared_out_first_fit_largest_first_within_the_limit() -> None:
    share_out = _wheelhouse().share_out
    sizes = [("a", 50), ("b", 30), ("c", 25), ("d", 20), ("e", 5)]
    parts = share_out(sizes, 60)
    assert parts == [["a", "e"], ["b", "c"], ["d"]]
    assert sorted(n for p in parts for n in p) == ["a", "b", "c", "d", "e"]
    with pytest.raises(SystemExit, match="a alone is over"):
        share_out([("a", 61 * 2**20)], 60 * 2**20)


def _study(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "dev/gpu-study.sh"), *args],
        env={"PATH": "/usr/bin:/bin", "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_launcher_refuses_wheels_for_another_python(tmp_path: Path) -> None:
    (tmp_path / "python.txt").write_text("2.7\n")
    done = _study("install", str(tmp_path))
    assert done.returncode == 2 and "are for Python 2.7" in done.stderr


def test_the_launcher_refuses_a_python_without_torch(tmp_path: Path) -> None:
    done = _study("install", str(tmp_path), python="/usr/bin/false")
    assert done.returncode == 2 and "cannot import torch" in done.stderr


def test_the_launcher_names_its_commands() -> None:
    done = _study("bogus")
    assert done.returncode == 2 and "usage: dev/gpu-study.sh install DIR" in done.stderr


@pytest.mark.skipif((ROOT / ".gpu-site").exists(), reason="a .gpu-site is installed here")
def test_the_launcher_will_not_run_before_the_wheels_are_in() -> None:
    done = _study("run", "/tmp/nowhere")
    assert done.returncode == 2 and "for each part first" in done.stderr
