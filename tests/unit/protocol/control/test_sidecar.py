"""The control sidecar as a process of its own: it imports neither hivemind nor torch, and
a start frame it cannot serve is answered with the reason, then an exit.

py-libp2p cannot be imported next to hivemind, so the sidecar is only ever exercised in
child processes here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from protocol.control import _process
from protocol.control.frames import encode_frame, read_frame

ROOT = Path(__file__).resolve().parents[4]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sidecar_and_client_keep_their_imports_apart() -> None:
    check = textwrap.dedent(
        """
        import sys
        import protocol.control.channel
        assert not [m for m in sys.modules if m.startswith("libp2p")], "control imports libp2p"
        import protocol.control.sidecar
        heavy = [m for m in sys.modules if m.split(".")[0] in ("hivemind", "torch")]
        assert not heavy, heavy
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_a_start_frame_it_cannot_serve_is_answered_with_why(tmp_path: Path) -> None:
    proc = _process.spawn(None)
    try:
        start = {
            "op": "start",
            "key_file": str(tmp_path / "missing.key"),
            "listen_host": "127.0.0.1",
            "port": 0,
            "run": "run-1",
            "topics": ["atoll/run-1/heartbeat"],
            "max_bytes": 4096,
        }
        proc.stdin.write(encode_frame(start))  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        answer = read_frame(proc.stdout)  # type: ignore[arg-type]
    finally:
        _process.reap(proc, 30)
    assert answer["ev"] == "error" and "missing.key" in answer["error"]
    assert proc.returncode == 2


def test_every_start_field_is_checked_before_anything_starts() -> None:
    result = _python(
        """
        import json
        from protocol.control._pipe import StartConfig
        good = {"op": "start", "key_file": "k", "listen_host": "::1", "port": 1,
                "run": "r", "topics": ["t", "t"], "max_bytes": 2048}
        config = StartConfig.from_frame(good)
        out = {"kept": list(config.topics), "addr": str(config.listen_addr)}
        for field, bad in [("op", "stop"), ("key_file", ""), ("listen_host", "host"),
                           ("port", 70000), ("run", ""), ("topics", []),
                           ("max_bytes", 10)]:
            try:
                StartConfig.from_frame(dict(good, **{field: bad}))
                out[field] = "accepted"
            except ValueError as e:
                out[field] = str(e)
        print(json.dumps(out))
        """
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out.pop("kept") == ["t"] and out.pop("addr") == "/ip6/::1/tcp/1"
    assert "accepted" not in out.values()
    assert "key_file" in out["key_file"] and "listen_host" in out["listen_host"]
    assert "max_bytes" in out["max_bytes"] and "first frame" in out["op"]
