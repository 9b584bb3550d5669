"""The fork server: children forked from it run a module as ``python -m`` would, with the
launcher's output, environment, directory and session, and report how they ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from node.ops import forkserver
from node.ops.forkserver import ForkedProcess, ForkServer
from node.ops.forkserver_process import refusal
from tests.waiting import wait_until

CHILD = "tests.unit.node._forked_child"


@pytest.fixture(scope="module")
def server():
    s = ForkServer(preload=("json",))  # the imports are not what these tests are about
    assert s.start()
    try:
        yield s
    finally:
        s.close()


def _spawn(server: ForkServer, out, *args: str, env=None, cwd=None) -> ForkedProcess:
    child = server.spawn(
        [sys.executable, "-m", CHILD, *args],
        env={**os.environ, "FORKED_CHILD_MARK": "mark"} if env is None else env,
        cwd=str(cwd or os.getcwd()),
        out_fd=out.fileno(),
        err_fd=out.fileno(),
        new_session=True,
    )
    assert child is not None
    return child


def test_a_child_runs_the_module_with_the_launchers_settings(server, tmp_path) -> None:
    with open(tmp_path / "out.log", "ab") as out:
        child = _spawn(server, out, "3", "0", cwd=tmp_path)
        assert child.wait(30) == 3
    assert child.returncode == 3 and child.poll() == 3
    first, second = (tmp_path / "out.log").read_text().splitlines()
    report = json.loads(first)
    assert report == {
        "argv": ["3", "0"],
        "env": "mark",
        "cwd": str(tmp_path),
        "stdin": "",
        "leader": True,
        "name": "__main__",
    }
    assert second == "to stderr"
    assert report_title(server, tmp_path) == f"{sys.executable} -m {CHILD} 0 5"


def report_title(server: ForkServer, tmp_path) -> str:
    """What ps shows of a running child."""
    with open(tmp_path / "title.log", "ab") as out:
        child = _spawn(server, out, "0", "5")
        try:
            # the title is set before the module runs
            wait_until(lambda: (tmp_path / "title.log").read_text(), 5, 0.05)
            return " ".join(psutil.Process(child.pid).cmdline()).strip()
        finally:
            child.kill()
            child.wait(30)


def test_a_signal_ends_a_child_and_is_its_returncode(server, tmp_path) -> None:
    with open(tmp_path / "out.log", "ab") as out:
        child = _spawn(server, out, "0", "60")
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.3)
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
        child.kill()  # an ended child is left alone
    assert child.returncode == -signal.SIGTERM


def test_an_environment_read_at_import_is_refused(server, tmp_path) -> None:
    with open(tmp_path / "out.log", "ab") as out:
        refused = server.spawn(
            [sys.executable, "-m", CHILD, "0", "0"],
            env={**os.environ, "OMP_NUM_THREADS": "7"},
            cwd=str(tmp_path),
            out_fd=out.fileno(),
            err_fd=out.fileno(),
            new_session=False,
        )
    assert refused is None
    assert server.alive  # a refusal is one request's, not the server's end
    base = {"A": "1", "PYTHONUNBUFFERED": "0"}
    assert refusal({"A": "2", "PYTHONUNBUFFERED": "1"}, base) is None
    assert "TORCH_HOME" in refusal({**base, "TORCH_HOME": "/x"}, base)
    assert "ATOLL_LINK_SHAPE" in refusal({"ATOLL_LINK_SHAPE": "x"}, {})


def test_a_closed_server_forks_nothing_and_its_children_go_on(tmp_path) -> None:
    s = ForkServer(preload=())
    assert s.start()
    with open(tmp_path / "out.log", "ab") as out:
        child = _spawn(s, out, "0", "60")
        s.close()
        assert not s.alive
        assert s.spawn([sys.executable, "-m", CHILD], {}, str(tmp_path), 1, 2, False) is None
        os.kill(child.pid, 0)  # still running, though its exit can no longer be reported
        child.kill()
        child.wait(30)
    assert child.returncode == -1


def test_a_server_that_cannot_import_is_not_used(caplog) -> None:
    s = ForkServer(preload=("no_such_module_anywhere",))
    assert not s.start()
    assert not s.alive
    assert "fork server did not start" in caplog.text


def test_popen_falls_back_to_subprocess(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(forkserver.ENV_VAR, "0")
    with open(tmp_path / "out.log", "ab") as out:
        proc = forkserver.popen(
            [sys.executable, "-m", CHILD, "0", "0"], stdout=out, stderr=subprocess.STDOUT
        )
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(30) == 0
    monkeypatch.delenv(forkserver.ENV_VAR)
    other = forkserver.popen([sys.executable, "-c", "pass"])  # not a python -m command
    assert isinstance(other, subprocess.Popen) and other.wait(30) == 0
