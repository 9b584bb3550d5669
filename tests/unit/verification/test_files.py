"""Whole-or-nothing writes (verification/files.py): the file is replaced whole, a failed write
leaves the previous file and no temporary file, and durable writes reach the disk."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from verification.files import atomic_file, atomic_write


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "meta.json"
    atomic_write(path, "first\n")
    atomic_write(path, b"second\n")
    assert path.read_bytes() == b"second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_a_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    atomic_write(path, b"old")
    with pytest.raises(RuntimeError, match="half way"), atomic_file(path) as f:
        f.write(b"new, but only")
        raise RuntimeError("half way")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_an_error_without_a_file_name_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as info, atomic_file(path, "w") as f:
        f.write("x")
        full_disk()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


def test_replace_false_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    atomic_write(path, "mine", replace=False)
    with pytest.raises(FileExistsError):
        atomic_write(path, "theirs", replace=False)
    assert path.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]


def test_the_temporary_file_is_a_sibling_with_the_given_name_and_mode(
    tmp_path: Path, monkeypatch
) -> None:
    seen: list[tuple[str, str]] = []
    real = os.replace

    def spy(src, dst) -> None:
        seen.append((str(src), str(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = tmp_path / "ckpt-00000001.pt"
    atomic_write(path, b"payload", prefix=".ckpt-00000001-", perms=0o600)
    ((src, dst),) = seen
    assert Path(src).parent == tmp_path and Path(src).name.startswith(".ckpt-00000001-")
    assert src.endswith(".tmp") and dst == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_only_a_durable_write_fsyncs(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real(fd))
    atomic_write(tmp_path / "live.json", "{}", durable=False)
    assert calls == []
    atomic_write(tmp_path / "meta.json", "{}")
    assert len(calls) == 2  # the file, then its directory
