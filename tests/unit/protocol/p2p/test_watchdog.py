"""The watchdog (protocol.p2p.watchdog) on real processes: ``sleep`` children stand in
for p2pd and the DHT process, and a small Python process stands in for the node."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from protocol.p2p.watchdog import Watchdog, _parse, terminate_processes

ROOT = Path(__file__).resolve().parents[4]

# A node that starts the watchdog and two helpers, tracks both, then only the second
# (each report replaces the last), and says who is who once the watchdog has read its
# reports (nothing left in the pipe: FIONREAD), so a kill cannot overtake them.
_NODE = """
import fcntl, json, subprocess, termios, time
from array import array
from protocol.p2p.watchdog import Watchdog

dog = Watchdog.spawn()
kept, ended = (subprocess.Popen(["sleep", "120"]) for _ in range(2))
dog.track([kept.pid, ended.pid])
dog.track([ended.pid])
unread, deadline = array("i", [1]), time.monotonic() + 10
while unread[0] and time.monotonic() < deadline:
    fcntl.ioctl(dog._proc.stdin.fileno(), termios.FIONREAD, unread)
    time.sleep(0.01)
print(json.dumps({"watchdog": dog.pid, "kept": kept.pid, "ended": ended.pid}), flush=True)
time.sleep(120)
"""

# A child that asks to be sent SIGTERM when the thread that forked it exits.
_ARMED = """
import signal, time
from protocol.p2p.watchdog import set_parent_death_signal
print("armed" if set_parent_death_signal(signal.SIGTERM) else "refused", flush=True)
time.sleep(120)
"""

# Its parent, which reports the child's pid once it is armed, then waits to be killed.
_MIDDLE = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {_ARMED!r}], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def reap() -> Iterator[list[int | subprocess.Popen]]:
    """Processes (ours, or pids of others') to SIGKILL after the test, whatever it left."""
    procs: list[int | subprocess.Popen] = []
    yield procs
    for proc in procs:
        if isinstance(proc, subprocess.Popen):
            proc.kill()
            proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc, signal.SIGKILL)


def _sleep(reap: list[int | subprocess.Popen]) -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "120"])
    reap.append(proc)
    return proc


@pytest.mark.timeout(30)
def test_a_killed_node_takes_the_helpers_it_reported_last_with_it(
    reap: list[int | subprocess.Popen],
) -> None:
    node = _python(_NODE)
    reap.append(node)
    assert node.stdout is not None
    report = json.loads(node.stdout.readline())
    reap.extend([report["kept"], report["ended"], report["watchdog"]])
    assert all(_alive(report[k]) for k in ("watchdog", "kept", "ended"))

    node.kill()  # SIGKILL: the node cleans nothing up itself
    node.wait(5)

    assert _wait_until(lambda: not _alive(report["ended"]), 10), "tracked helper survived"
    assert _wait_until(lambda: not _alive(report["watchdog"]), 10), "watchdog did not exit"
    assert _alive(report["kept"])  # reported once, then replaced: not the watchdog's to end


@pytest.mark.timeout(30)
def test_a_closed_watchdog_exits_and_ends_nothing(reap: list[int | subprocess.Popen]) -> None:
    helper = _sleep(reap)
    dog = Watchdog.spawn()
    reap.append(dog.pid)
    dog.track([helper.pid])
    assert [pid for pid, _ in dog.tracked] == [helper.pid]
    assert dog.is_alive()

    dog.close()

    assert not dog.is_alive()
    assert dog.tracked == []
    assert helper.poll() is None  # the node ended its helpers itself, or meant to keep them


@pytest.mark.timeout(30)
def test_track_covers_the_descendants_of_each_root(reap: list[int | subprocess.Popen]) -> None:
    shell = subprocess.Popen(["sh", "-c", "sleep 120 & wait"])
    reap.append(shell)
    root = psutil.Process(shell.pid)
    assert _wait_until(lambda: bool(root.children()), 10), "the shell did not start its child"
    child = root.children()[0].pid
    reap.append(child)
    dog = Watchdog.spawn()
    reap.append(dog.pid)
    try:
        dog.track([shell.pid, 999_999_999])  # a pid that does not exist is skipped
        assert sorted(pid for pid, _ in dog.tracked) == sorted([shell.pid, child])
    finally:
        dog.close()


@pytest.mark.timeout(30)
def test_terminate_ends_processes_and_kills_those_that_ignore_sigterm(
    reap: list[int | subprocess.Popen],
) -> None:
    polite = _sleep(reap)
    stubborn = _python(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    reap.append(stubborn)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
    pairs = [(p.pid, psutil.Process(p.pid).create_time()) for p in (polite, stubborn)]

    started = time.monotonic()
    survivors = terminate_processes(pairs, grace=0.5)

    assert survivors == []
    assert polite.wait(5) == -signal.SIGTERM
    assert stubborn.wait(5) == -signal.SIGKILL
    assert time.monotonic() - started < 5


@pytest.mark.timeout(30)
def test_terminate_leaves_a_pid_whose_create_time_differs_alone(
    reap: list[int | subprocess.Popen],
) -> None:
    other = _sleep(reap)
    created = psutil.Process(other.pid).create_time()
    # as if the tracked process had ended and its pid been given to this one
    assert terminate_processes([(other.pid, created - 60.0)], grace=0.5) == []
    assert other.poll() is None


@pytest.mark.timeout(30)
def test_parent_death_signal_ends_a_child_when_its_parent_is_killed(
    reap: list[int | subprocess.Popen],
) -> None:
    middle = _python(_MIDDLE)
    reap.append(middle)
    assert middle.stdout is not None
    child, state = middle.stdout.readline().split()
    reap.append(int(child))
    assert state == "armed"
    assert _alive(int(child))

    middle.kill()
    middle.wait(5)

    assert _wait_until(lambda: not _alive(int(child)), 10), "the armed child outlived its parent"


def test_report_lines_that_do_not_parse_are_ignored() -> None:
    assert _parse(b"[[12, 1.5], [34, 2]]") == [(12, 1.5), (34, 2.0)]
    for line in (b"", b"not json", b'{"a": 1}', b"[[1]]", b'[["x", 1.0]]'):
        assert _parse(line) is None


@pytest.mark.timeout(30)
def test_terminate_removes_the_socket_a_killed_p2pd_listened_on(
    reap: list[int | subprocess.Popen], tmp_path: Path
) -> None:
    """p2pd leaves its ``-listen=/unix/PATH`` socket behind when it is killed; the
    watchdog removes it (and nothing else: a plain file named the same stays)."""
    path, plain = tmp_path / "p2pd-x.sock", tmp_path / "p2pd-y.sock"
    plain.write_text("not a socket")
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({str(path)!r})\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    listening = subprocess.Popen(
        [sys.executable, "-c", code, f"-listen=/unix{path}", f"-listen=/unix{plain}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    reap.append(listening)
    assert listening.stdout is not None and listening.stdout.readline().strip() == "ready"
    assert path.is_socket()
    created = psutil.Process(listening.pid).create_time()
    assert terminate_processes([(listening.pid, created)], grace=0.5) == []
    assert not path.exists() and plain.read_text() == "not a socket"
