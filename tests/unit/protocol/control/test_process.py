"""One sidecar process's steps: greeting it (ready, refused, or silent past its time),
ending it, and the addresses a channel keeps for restarts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

from protocol.control import _process
from protocol.control.frames import write_frame

ROOT = Path(__file__).resolve().parents[4]


def _child(code: str) -> subprocess.Popen[bytes]:
    """A stand-in sidecar: reads the start frame, then does what ``code`` says."""
    script = textwrap.dedent(
        """
        import sys, time
        from protocol.control.frames import read_frame, write_frame
        start = read_frame(sys.stdin.buffer)
        """
    ) + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def _write(proc: subprocess.Popen[bytes], frame: dict) -> None:
    write_frame(proc.stdin, frame)  # type: ignore[arg-type]


def test_a_ready_sidecar_answers_its_start_frame() -> None:
    proc = _child("write_frame(sys.stdout.buffer, {'ev': 'ready', 'port': start['port']})")
    try:
        ready, why = _process.greet(proc, {"op": "start", "port": 4242}, 30, _write)
    finally:
        _process.reap(proc, 10)
    assert why is None and ready == {"ev": "ready", "port": 4242}


def test_a_refusal_is_passed_on_with_its_reason() -> None:
    proc = _child("write_frame(sys.stdout.buffer, {'ev': 'error', 'error': 'bad key'})")
    try:
        ready, why = _process.greet(proc, {"op": "start"}, 30, _write)
    finally:
        _process.reap(proc, 10)
    assert ready is None and why == "bad key"


def test_a_silent_sidecar_is_killed_at_its_ready_timeout() -> None:
    proc = _child("time.sleep(60)")
    try:
        ready, why = _process.greet(proc, {"op": "start"}, 0.5, _write)
    finally:
        _process.reap(proc, 10)
    assert ready is None and "no ready event" in str(why)
    assert proc.returncode is not None and proc.returncode < 0  # killed, and reaped


def test_reap_kills_what_does_not_exit_in_time() -> None:
    proc = _child("time.sleep(60)")
    _process.reap(proc, 0.2)
    assert proc.returncode is not None
    _process.kill(proc)  # already gone: no error


def test_the_tcp_port_is_the_first_address_that_has_one() -> None:
    assert _process.tcp_port(["/ip4/1.2.3.4/udp/9", "/ip4/1.2.3.4/tcp/4001/p2p/x"]) == 4001
    assert _process.tcp_port(["/ip4/1.2.3.4/tcp/notaport", "/dns/x"]) is None


def test_known_addresses_are_kept_most_recent_last_within_a_limit() -> None:
    known: OrderedDict[str, list[str]] = OrderedDict()
    _process.remember(known, {"a": ["/ip4/1.1.1.1/tcp/1"], "b": ["/ip4/2.2.2.2/tcp/2"]}, 2)
    _process.remember(known, {"a": ["/ip4/1.1.1.1/tcp/9"], "c": ["/ip4/3.3.3.3/tcp/3"]}, 2)
    assert list(known) == ["a", "c"] and known["a"] == ["/ip4/1.1.1.1/tcp/9"]
    _process.remember(known, {"d": "not a list", "e": [7]}, 2)  # nothing usable
    _process.remember(known, "not a map", 2)
    assert list(known) == ["a", "c"]
