"""Start-up failures become one line an operator can act on (no network, no processes)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node.cli import errors, main, operating, running
from node.config import DataConfig, load_config
from node.data.corpus import DataError, load_corpus
from node.ops import swarm
from node.run.metrics import EventLog, StatusWriter
from node.train.checkpoint import load_latest, save_checkpoint
from verification.errors import VerificationError

PEER = "12D3KooWPKQ3csLUY6NdyC2WjfCLkaTUSPoEmrY46fYwabtZDpbZ"


def _one_line(capsys, fix: bool = True) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atoll: "), err
    assert "; " in err[0] or not fix  # what is wrong; what to do
    return err[0]


# ---- the CLI's mapping --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "needle"),
    [("not-a-multiaddr", "is not a multiaddr"), ("/ip4/127.0.0.1/tcp/4001", "/p2p/<PeerID>")],
)
def test_initial_peers_follow_the_config_rules(tmp_path, capsys, peer, needle) -> None:
    assert main(["run", "--data-dir", str(tmp_path), "--initial-peers", peer]) == 2
    line = _one_line(capsys, fix=False)  # network.initial_peers' own words, which say how
    assert line.startswith("atoll: --initial-peers: ") and needle in line and peer in line
    assert not list(tmp_path.iterdir())  # refused before anything was made


def test_initial_peers_with_a_peer_id_pass() -> None:
    good = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"
    assert running.initial_peers([good]) == (good,)


def test_an_unexpected_error_is_one_line_exit_1_traceback_at_debug(
    tmp_path, capsys, caplog, monkeypatch
) -> None:
    def boom(args) -> int:
        raise KeyError("boom")

    monkeypatch.setattr(operating, "cmd_status", boom)
    with caplog.at_level(logging.DEBUG):
        assert main(["status", "--data-dir", str(tmp_path)]) == 1
    line = _one_line(capsys)
    assert line == "atoll: internal error: KeyError('boom'); run with -v for the traceback"
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert debug and debug[-1].exc_info[0] is KeyError


@pytest.mark.parametrize(
    "exc",
    [
        VerificationError("bad_signature", "spec.toml"),
        PermissionError(errno.EACCES, "Permission denied", "/x/status.json"),
        swarm.NodeFailed(
            swarm.SwarmProcess(1, Path("/nonexistent"), SimpleNamespace(returncode=2), None)
        ),
    ],
)
def test_known_errors_exit_2(tmp_path, capsys, monkeypatch, exc) -> None:
    def fail(args) -> int:
        raise exc

    monkeypatch.setattr(operating, "cmd_status", fail)
    assert main(["status", "--data-dir", str(tmp_path)]) == 2
    _one_line(capsys)


def test_transport_start_errors_exit_2(tmp_path, capsys, monkeypatch) -> None:
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from protocol.p2p.transport import BootstrapUnreachable, NotDialable

    failed = RuntimeError("transport failed to start")
    failed.__cause__ = P2PDaemonError("Daemon failed to start: no such thing")
    for exc, needle in [
        (BootstrapUnreachable("none of the initial peers answered: x; check them"), "x; check"),
        (NotDialable("peer p cannot dial back; a copied data directory?"), "copied data"),
        (failed, "the network side did not start (Daemon failed to start: no such thing)"),
    ]:

        def fail(args, exc=exc) -> int:
            raise exc

        monkeypatch.setattr(operating, "cmd_status", fail)
        assert main(["status", "--data-dir", str(tmp_path)]) == 2
        assert needle in _one_line(capsys)

    def bug(args) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(operating, "cmd_status", bug)
    assert main(["status", "--data-dir", str(tmp_path)]) == 1  # not a start-up error
    assert "internal error" in _one_line(capsys)


def test_a_bootstrap_node_whose_dht_is_not_up_yet_is_tried_again_like_an_absent_one() -> None:
    # its p2pd answers before its DHT does: hivemind's DHT then gives up at once, which
    # must read as "not answering yet" (the daemon retries for network.join_timeout),
    # not as an internal error
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from protocol.p2p.transport import BootstrapUnreachable, startup_error

    peers = ("/ip4/10.0.0.1/tcp/31337/p2p/" + PEER,)
    dht = RuntimeError(
        "DHTNode bootstrap failed: none of the initial_peers responded to a ping. "
        "(set ensure_bootstrap_success=False to ignore)"
    )
    daemon = P2PDaemonError("failed to connect to bootstrap peers")
    for exc in (dht, daemon):
        mapped = startup_error(exc, peers)
        assert isinstance(mapped, BootstrapUnreachable) and peers[0] in str(mapped)
    assert startup_error(RuntimeError("a bug"), peers) is None
    assert startup_error(KeyError("x"), peers) is None


def test_file_problems_name_the_place_and_the_fix(tmp_path) -> None:
    d = tmp_path / "node"

    def line(code: int, name: Path | None, data_dir: Path | None = d) -> str:
        return errors.file_problem(OSError(code, os.strerror(code), name), data_dir)

    assert line(errno.EROFS, d / "events.jsonl") == (
        f"cannot write to the data directory {d} (read-only file system); "
        "choose a writable --data-dir"
    )
    assert line(errno.ENOSPC, d / "checkpoints" / "ckpt-00000003.pt") == (
        f"no space left on the disk of the data directory {d} (writing "
        f"{d / 'checkpoints' / 'ckpt-00000003.pt'}); free some space or choose another --data-dir"
    )
    assert line(errno.ENOSPC, None) == (
        f"no space left on the disk of the data directory {d}; free some space or "
        "choose another --data-dir"
    )
    assert line(errno.EPERM, d / "status.json").startswith(
        f"no permission to use {d / 'status.json'} (operation not permitted); fix its permissions"
    )
    assert "is a directory where a file belongs" in line(errno.EISDIR, d / "x")
    d.write_text("")  # a file where the data directory should be
    assert line(errno.EEXIST, d) == (
        f"the data directory {d} is a file, not a directory; choose another --data-dir"
    )
    assert line(errno.ENOTDIR, d / "sub", d / "sub") == (
        f"the data directory {d / 'sub'} cannot be made: {d} is a file, not a directory; "
        "choose another --data-dir"
    )
    assert line(errno.ENOENT, Path("/x/y"), None).endswith("; check the path and its permissions")


# ---- keygen --------------------------------------------------------------------------------


def test_keygen_makes_missing_directories_private(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default .atoll/node on a fresh checkout
    old = os.umask(0o022)
    try:
        assert main(["keygen"]) == 0
    finally:
        os.umask(old)
    for d in (tmp_path / ".atoll", tmp_path / ".atoll" / "node"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    key = tmp_path / ".atoll" / "node" / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "PeerID 12D3KooW" in capsys.readouterr().out


def test_keygen_over_a_bad_key_says_how_to_replace_it(tmp_path, capsys) -> None:
    (tmp_path / "identity.key").write_bytes(b"\x08\x01\x12\x40" + bytes(10))
    assert main(["keygen", "--data-dir", str(tmp_path)]) == 2
    line = _one_line(capsys)
    assert "is not a valid identity key (truncated" in line and "--force" in line


# ---- the corpus ----------------------------------------------------------------------------


def test_empty_files_are_too_little_text_naming_the_glob(tmp_path) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"")
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(paths=(pattern,)), 64)
    text = str(info.value)
    assert "too little text for one context window" in text and pattern in text
    assert "(2 files, 0 bytes)" in text and "model.context + 1 = 65" in text


def test_the_minimum_corpus_is_one_window_per_split(tmp_path) -> None:
    context = 16
    path = tmp_path / "one.txt"
    cfg = DataConfig(paths=(str(path),), val_fraction=0.5)
    path.write_bytes(bytes(range(2 * (context + 1))))  # context + 1 bytes in each split
    corpus = load_corpus(cfg, context)
    assert corpus.train.numel() == corpus.val.numel() == context + 1
    from node.data.corpus import BatchStream

    x, y = BatchStream(corpus.val, 2, context, "k").next()  # the one window there is
    assert torch.equal(x[0], corpus.val[:context].long())
    path.write_bytes(bytes(range(2 * (context + 1) - 1)))  # one byte short in train
    with pytest.raises(DataError, match="the train split has 16 bytes"):
        load_corpus(cfg, context)


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [("none/*.txt", "; check the directory and the pattern"), ("none.txt", "(it does not exist)")],
)
def test_missing_paths_say_what_to_check(tmp_path, pattern, needle) -> None:
    with pytest.raises(DataError, match="matches no readable file") as info:
        load_corpus(DataConfig(paths=(str(tmp_path / pattern),)), 16)
    assert needle in str(info.value)


# ---- a full disk ---------------------------------------------------------------------------


def _disk_fills_after(monkeypatch, budget: int) -> None:
    """Files opened through os.fdopen fail with ENOSPC once ``budget`` bytes are written."""
    real = os.fdopen
    left = [budget]

    class Full:
        def __init__(self, f) -> None:
            self._f = f

        def write(self, data) -> int:
            if len(data) > left[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self._f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Full(real(*a, **k)))


def test_a_checkpoint_on_a_full_disk_leaves_the_previous_one_newest(tmp_path, monkeypatch) -> None:
    state = {"w": torch.arange(50_000, dtype=torch.float32)}
    save_checkpoint(tmp_path, 1, state)
    _disk_fills_after(monkeypatch, 10_000)
    with pytest.raises(OSError) as info:  # not torch's RuntimeError
        save_checkpoint(tmp_path, 2, {"w": state["w"] + 1})
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tmp_path / "ckpt-00000002.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]  # no temp file
    monkeypatch.undo()
    info_, loaded = load_latest(tmp_path)
    assert info_.round == 1 and torch.equal(loaded["w"], state["w"])


def test_status_and_events_name_their_file_on_a_full_disk(tmp_path, monkeypatch) -> None:
    status = StatusWriter(tmp_path / "status.json")
    _disk_fills_after(monkeypatch, 0)
    with pytest.raises(OSError) as info:
        status.update(force=True, round=1)
    assert info.value.filename == str(tmp_path / "status.json")
    assert [p.name for p in tmp_path.iterdir()] == []
    monkeypatch.undo()
    with EventLog(tmp_path / "events.jsonl") as events:
        events._f = SimpleNamespace(  # the raw file, full
            write=lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")),
            closed=False,
            close=lambda: None,
        )
        with pytest.raises(OSError) as info:
            events.write("round", round=1)
    assert info.value.filename == str(tmp_path / "events.jsonl")


# ---- shutdown after a failed start ---------------------------------------------------------


def test_teardown_after_a_failed_start_never_raises(tmp_path, caplog) -> None:
    from node.daemon import Node
    from node.run.metrics import EventLog

    def fail(*args, **kwargs) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "status.json"))

    node = Node(load_config(None, [f"run.data_dir={str(tmp_path)!r}"]))
    # the write that failed at start fails again
    node.logs = (SimpleNamespace(update=fail), EventLog(tmp_path / "events.jsonl"))  # type: ignore[assignment]
    node.transport = SimpleNamespace(shutdown=fail)  # type: ignore[assignment]
    with caplog.at_level(logging.DEBUG):
        node._teardown(quiet=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("writing the final status failed" in r.getMessage() for r in caplog.records)
    node._teardown(quiet=False)  # a clean stop says so at warning level
    assert any(r.levelno == logging.WARNING for r in caplog.records)


# ---- atoll swarm ---------------------------------------------------------------------------


def test_swarm_reports_a_failed_node_with_its_own_line(tmp_path) -> None:
    (tmp_path / "node.log").write_text(
        "2026-01-01 INFO node.daemon: starting\n"
        "atoll: /x/identity.key is not a valid identity key (the file is empty); restore it\n"
    )
    node = swarm.SwarmProcess(1, tmp_path, SimpleNamespace(returncode=2), None)
    assert swarm.error_line(node).startswith("/x/identity.key is not a valid identity key")
    text = str(swarm.NodeFailed(node))
    assert text.startswith("node 1 failed: /x/identity.key is not a valid identity key")
    assert str(tmp_path / "node.log") in text
    (tmp_path / "node.log").write_text("Segmentation fault\n")
    assert swarm.error_line(node) == "exited with code 2"
    late = swarm.NodeFailed(node, "it did not come up within 90 s")
    assert str(late).startswith("node 1 failed: it did not come up within 90 s (the others")
