"""The one line an operator reads when a command fails: what failed, and what to do."""

from __future__ import annotations

import errno
from pathlib import Path

from node.cli.errors import file_problem, known_error
from verification.errors import VerificationError


def test_bad_input_is_its_own_message_and_the_unexpected_is_none() -> None:
    assert known_error(ValueError("config error: sync.codec")) == "config error: sync.codec"
    assert known_error(VerificationError("bad_signature", "spec.json")).endswith(
        "; check the file or peer it names"
    )
    assert known_error(KeyError("internal")) is None
    assert known_error(ZeroDivisionError()) is None


def test_a_full_disk_names_the_place_and_the_fix(tmp_path: Path) -> None:
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt.pt"))
    line = file_problem(exc, tmp_path)
    assert line == (
        f"no space left on the disk of the data directory {tmp_path} (writing "
        f"{tmp_path / 'ckpt.pt'}); free some space or choose another --data-dir"
    )
    assert known_error(exc) is not None and "choose another path" in known_error(exc)


def test_permissions_read_only_disks_and_directories_each_say_what_to_do(tmp_path) -> None:
    denied = file_problem(OSError(errno.EACCES, "Permission denied", "/etc/x"))
    assert denied == "no permission to use /etc/x (permission denied); fix its permissions " + (
        "or choose another path"
    )
    read_only = file_problem(OSError(errno.EROFS, "Read-only file system", "/ro"), Path("/ro"))
    assert "choose a writable --data-dir" in read_only
    folder = file_problem(OSError(errno.EISDIR, "Is a directory", "/tmp/x"))
    assert folder.startswith("/tmp/x is a directory where a file belongs")


def test_a_file_where_the_data_directory_belongs_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "node"
    blocker.write_text("")
    line = file_problem(OSError(errno.EEXIST, "File exists", str(blocker)), blocker)
    assert (
        line
        == f"the data directory {blocker} is a file, not a directory; choose another --data-dir"
    )
    deeper = blocker / "sub"
    line = file_problem(OSError(errno.ENOTDIR, "Not a directory", str(deeper)), deeper)
    assert f"cannot be made: {blocker} is a file" in line
