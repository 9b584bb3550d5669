"""The service file and the container recipe in deploy/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _settings(unit: str) -> dict[str, str]:
    out = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def test_the_unit_restarts_on_failure_kills_its_whole_group_and_keeps_data_in_var_lib() -> None:
    unit = (DEPLOY / "atoll.service").read_text()
    s = _settings(unit)
    assert s["Restart"] == "on-failure" and s["KillMode"] == "control-group"
    assert s["KillSignal"] == "SIGTERM" and int(s["TimeoutStopSec"]) >= 60
    assert s["StateDirectory"] == "atoll" and "--data-dir /var/lib/atoll/node" in s["ExecStart"]
    assert s["ExecStart"].startswith("/opt/atoll/bin/atoll run ")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd is not installed")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify also checks that ExecStart's program exists: point it at this install's
    atoll = Path(sys.executable).with_name("atoll")
    if not atoll.exists():
        pytest.skip("the atoll console script is not installed next to this Python")
    unit = (DEPLOY / "atoll.service").read_text().replace("/opt/atoll/bin/atoll", str(atoll))
    (tmp_path / "atoll.service").write_text(unit)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "atoll.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_image_runs_atoll_and_pins_the_cpu_torch_unless_told_otherwise() -> None:
    recipe = (DEPLOY / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in recipe
    assert "ARG TORCH=torch==2.13.0" in recipe
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in recipe
    assert (
        'ENTRYPOINT ["/opt/atoll/bin/atoll", "run", "--data-dir", "/var/lib/atoll/node"]' in recipe
    )
    assert "USER atoll" in recipe and "VOLUME /var/lib/atoll" in recipe
    # every top-level package the project installs is copied in
    for package in ("node", "protocol", "verification", "benchmarks"):
        assert f"COPY {package} /src/{package}" in recipe
