"""Every way a node fails to start ends in one line, exit code 2, and no process left.

Each case runs ``python -m node.cli`` for real on its own data directory. The cases
that fail before anything networked starts run a few at a time (each costs an
interpreter start and little else); those that start p2pd, a DHT process or the
control sidecar run one by one while the test records every descendant of the node,
and check that none outlives it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from node.ops import forkserver
from node.ops.swarm import QUICK_WORKLOAD
from node.train.checkpoint import load_latest
from tests.integration.conftest import alive, wait_until
from verification.identity import Identity

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ATOLL = [sys.executable, "-m", "node.cli"]
QUICK = [arg for item in QUICK_WORKLOAD for arg in ("--set", item)]
IS_ROOT = os.geteuid() == 0


class Unavailable(Exception):
    """This machine cannot set the case up (not root, no tmpfs): the test skips."""


@dataclass
class Result:
    code: int
    stderr: str
    seen: set[int]  # every descendant of the command observed while it ran


def run_atoll(
    args: list[str], timeout: float, watch: bool = False, tick: Callable[[], None] | None = None
) -> Result:
    """Run ``atoll ARGS`` to its end (killed after ``timeout``).

    Args:
        watch: record the command's descendants every tenth of a second.
        tick: called as often while it runs (to change its world from outside).
    """
    seen: set[int] = set()
    with tempfile.TemporaryFile("w+") as err:
        proc = forkserver.popen(
            [*ATOLL, *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            for _ in range(int(timeout / 0.1)):
                if proc.poll() is not None:
                    break
                if watch:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
                if tick is not None:
                    tick()
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        err.seek(0)
        return Result(proc.returncode, err.read(), seen)


def one_line(result: Result, *needles: str, code: int = 2) -> str:
    """The command's single ``atoll:`` line, last on stderr, with no traceback."""
    assert result.code == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith("atoll: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert result.stderr.rstrip().splitlines()[-1] == lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def leftovers(result: Result, tag: Path) -> list[int]:
    """Processes still alive that the command started, or that name ``tag`` (p2pd's key)."""
    named = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and any(str(tag) in a for a in p.info["cmdline"] or ()):
                named.append(p.pid)
    return [p for p in result.seen if alive(p)] + [p for p in named if alive(p)]


def assert_nothing_left(result: Result, tag: Path) -> None:
    # torch's shared-memory manager lingers a few seconds after its parent on its own
    wait_until(lambda: not leftovers(result, tag), 15, 0.5)
    left = leftovers(result, tag)
    for pid in left:  # never leave processes behind, even when failing
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    assert not left, [psutil.Process(p).cmdline() for p in left if alive(p)]


# ---- situations ------------------------------------------------------------------------


class Mounts:
    """Mounts and immutable flags made for the cases, undone at the end."""

    def __init__(self) -> None:
        self.undo: list[list[str]] = []

    def tmpfs(self, path: Path, options: str) -> Path:
        if not IS_ROOT:
            raise Unavailable("mounting a tmpfs needs root")
        path.mkdir(parents=True, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise Unavailable(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.undo.append(["umount", "-l", str(path)])
        return path

    def read_only(self, path: Path) -> Path:
        """A directory nobody may write to: chattr +i as root (root ignores mode bits)."""
        path.mkdir(parents=True)
        if not IS_ROOT:
            path.chmod(0o500)
            self.undo.append(["chmod", "700", str(path)])
            return path
        if shutil.which("chattr") is None:
            raise Unavailable("chattr is not installed")
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"chattr +i fails here: {done.stderr.strip()}")
        self.undo.append(["chattr", "-i", str(path)])
        return path

    def close(self) -> None:
        for cmd in reversed(self.undo):
            subprocess.run(cmd, capture_output=True, timeout=30)


def _fill(path: Path) -> None:
    """Write zeros into ``path/fill`` until the file system is full (bounded by its size)."""
    limit = shutil.disk_usage(path).total // 65536 + 2
    with open(path / "fill", "wb") as f:
        for _ in range(limit):
            try:
                f.write(bytes(65536))
                f.flush()
            except OSError:
                return
    raise AssertionError(f"{path} did not fill up")


def _key(d: Path, content: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "identity.key").write_bytes(content)
    (d / "identity.key").chmod(0o600)
    return d


def _good_key() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        Identity.generate().save(Path(tmp) / "k")
        return (Path(tmp) / "k").read_bytes()


def _empty_files(d: Path) -> str:
    (d / "text").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt"):
        (d / "text" / name).write_bytes(b"")
    return str(d / "text" / "*.txt")


def _run(d: Path, *extra: str) -> list[str]:
    return ["run", "--data-dir", str(d), *QUICK, *extra]


def _swarm_without_corpus(d: Path) -> list[str]:
    no_text = f"data.paths=[{str(d / 'nothing' / '*.txt')!r}]"
    return ["swarm", "--nodes", "2", "--dir", str(d / "swarm"), *QUICK, "--set", no_text]


Prepare = Callable[[Path, Mounts], list[str]]

# name -> (how to make the situation and the command line, needles in the one line)
CASES: dict[str, tuple[Prepare, tuple[str, ...]]] = {
    "read_only_mount": (
        lambda d, m: _run(m.tmpfs(d / "node", "ro,size=1m")),
        ("cannot write to the data directory", "(read-only file system)", "a writable --data-dir"),
    ),
    "read_only_directory": (
        lambda d, m: _run(m.read_only(d / "node")),
        ("no permission to use", "fix its permissions or choose another --data-dir"),
    ),
    "full_disk": (
        lambda d, m: (_fill(m.tmpfs(d / "node", "size=256k")), _run(d / "node"))[1],
        ("no space left on the disk of the data directory", "free some space"),
    ),
    "key_empty": (
        lambda d, m: _run(_key(d / "node", b"")),
        ("identity.key is not a valid identity key (the file is empty)", "restore it"),
    ),
    "key_truncated": (
        lambda d, m: _run(_key(d / "node", _good_key()[:30])),
        ("is not a valid identity key (truncated", "delete it to make a new identity"),
    ),
    "key_garbled": (
        lambda d, m: _run(_key(d / "node", os.urandom(68))),
        ("is not a valid identity key (", "(the node gets a new PeerID)"),
    ),
    "key_is_a_directory": (
        lambda d, m: (os.makedirs(d / "node" / "identity.key"), _run(d / "node"))[1],
        ("identity.key is a directory, not an identity key file",),
    ),
    "data_dir_is_a_file": (
        lambda d, m: ((d / "node").write_text("x"), _run(d / "node"))[1],
        ("is a file, not a directory; choose another --data-dir",),
    ),
    "initial_peer_not_a_multiaddr": (
        lambda d, m: _run(d / "node", "--initial-peers", "not-a-multiaddr"),
        ("--initial-peers: 'not-a-multiaddr' is not a multiaddr (expected e.g. /ip4/",),
    ),
    "initial_peer_without_peer_id": (
        lambda d, m: _run(d / "node", "--initial-peers", "/ip4/127.0.0.1/tcp/4001"),
        ("needs its peer id: end it with /p2p/<PeerID>",),
    ),
    "corpus_of_empty_files": (
        lambda d, m: _run(d / "node", "--set", f"data.paths=[{_empty_files(d)!r}]"),
        ("too little text for one context window", "*.txt", "(3 files, 0 bytes)", "add more text"),
    ),
    "glob_matches_nothing": (
        lambda d, m: _run(d / "node", "--set", f"data.paths=[{str(d / 'none' / '*.txt')!r}]"),
        ("matches no readable file; check the directory and the pattern",),
    ),
    "path_does_not_exist": (
        lambda d, m: _run(d / "node", "--set", f"data.paths=[{str(d / 'none.txt')!r}]"),
        ("matches no readable file (it does not exist); check the path",),
    ),
    # every node starts at once and fails alike: the line names the first node
    "swarm_whose_first_node_fails": (
        lambda d, m: _swarm_without_corpus(d),
        ("node 0 failed: data.paths:", "matches no readable file", "node.log"),
    ),
}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> Iterator[dict[str, Result | str]]:
    """Run every quick case, three at a time; a str result is why it was skipped."""
    base = tmp_path_factory.mktemp("startup")
    mounts = Mounts()
    try:
        runs: dict[str, list[str]] = {}
        results: dict[str, Result | str] = {}
        for name, (prepare, _) in CASES.items():
            (base / name).mkdir()
            try:
                runs[name] = prepare(base / name, mounts)
            except Unavailable as exc:
                results[name] = str(exc)
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = {name: pool.submit(run_atoll, args, 90) for name, args in runs.items()}
            results.update({name: f.result() for name, f in futures.items()})
        results["_base"] = str(base)
        yield results
    finally:
        mounts.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_quick_failure_is_one_line(quick_results, name) -> None:
    result = quick_results[name]
    if isinstance(result, str):
        pytest.skip(result)
    line = one_line(result, *CASES[name][1])
    assert "; " in line or "--initial-peers" in line  # what is wrong; what to do
    assert_nothing_left(result, Path(quick_results["_base"]) / name)


@pytest.mark.timeout(60)
def test_verbose_puts_the_traceback_in_the_log(tmp_path) -> None:
    result = run_atoll(["-v", *_run(_key(tmp_path / "node", b""))], 50)
    assert result.code == 2 and "Traceback" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("atoll: ")


@pytest.mark.timeout(60)
def test_keygen_into_a_fresh_checkout_makes_private_directories(tmp_path) -> None:
    done = subprocess.run(
        [*ATOLL, "keygen"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    node = tmp_path / ".atoll" / "node"
    assert [oct(p.stat().st_mode & 0o777) for p in (node.parent, node)] == ["0o700"] * 2
    assert oct((node / "identity.key").stat().st_mode & 0o777) == "0o600"
    assert Identity.load(node / "identity.key").peer_id in done.stdout


# ---- failures after the network side started ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_unreachable_initial_peer_is_one_line(tmp_path) -> None:
    peer = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{Identity.generate().peer_id}"
    args = _run(tmp_path / "node", "--set", "network.join_timeout=2", "--initial-peers", peer)
    result = run_atoll(args, 80, watch=True)
    one_line(result, f"none of the initial peers answered: {peer} (tried for 2 s); check")
    assert result.seen, "p2pd never started"
    assert_nothing_left(result, tmp_path)


@pytest.mark.timeout(90)
def test_port_in_use_is_one_line(tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = _run(tmp_path / "node", "--set", f"network.port={port}")
        result = run_atoll(args, 80, watch=True)
    one_line(
        result,
        f"tcp port {port} on 127.0.0.1 is in use; stop the other program or choose another "
        "network.port",
    )
    assert_nothing_left(result, tmp_path)


@pytest.mark.timeout(150)
def test_swarm_names_the_node_that_failed_and_stops_the_others(tmp_path) -> None:
    directory = tmp_path / "swarm"
    _key(directory / "node1", b"\x08\x01\x12\x40garbage")  # only node 1 sees it
    args = ["swarm", "--nodes", "2", "--rounds", "2", "--dir", str(directory), *QUICK]
    result = run_atoll(args, 140, watch=True)
    one_line(result, "node 1 failed: ", "identity.key is not a valid identity key (truncated")
    assert result.seen, "no node started"
    assert_nothing_left(result, directory)


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    made = Mounts()
    try:
        yield made
    finally:
        made.close()


@pytest.mark.timeout(180)
def test_disk_full_mid_run_stops_cleanly_with_checkpoint_and_audit_intact(tmp_path, mounts) -> None:
    try:
        data_dir = mounts.tmpfs(tmp_path / "node", "size=16m")
    except Unavailable as exc:
        pytest.skip(str(exc))
    checkpoints = data_dir / "checkpoints"
    filled: list[float] = []

    def fill_after_two_checkpoints() -> None:
        if not filled and len(list(checkpoints.glob("ckpt-*.pt"))) >= 2:
            _fill(data_dir)
            filled.append(time.monotonic())

    solo = [
        *("network.min_peers=1", "sync.trigger='steps'", "sync.inner_steps=5"),
        "network.matchmaking_seconds=0.5",  # alone: nobody to wait for
    ]
    args = _run(data_dir, *(a for o in solo for a in ("--set", o)), "--rounds", "1000")
    result = run_atoll(args, 120, watch=True, tick=fill_after_two_checkpoints)
    assert filled, f"the node ended before its second checkpoint: {result.stderr[-2000:]}"
    one_line(result, f"no space left on the disk of the data directory {data_dir}")
    assert_nothing_left(result, data_dir)
    assert not list(checkpoints.glob(".ckpt-*.tmp"))  # the half-written one is gone
    found = load_latest(checkpoints)
    assert found is not None and found[0].round >= 2 and found[1]["round"] == found[0].round
    audit = run_atoll(["audit", "verify", "--data-dir", str(data_dir)], 50)  # still full
    assert audit.code == 0, audit.stderr
