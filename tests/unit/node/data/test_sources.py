"""Where a corpus comes from and how it is split: files named by paths or globs, and a
validation split the same on every machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.data.sources import SHARD_DTYPES, DataError, is_val, user_files


def test_paths_and_globs_name_each_file_once_sorted(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text(name)
    files = user_files((str(tmp_path / "*.txt"), str(tmp_path / "a.txt")))
    assert [path.name for _, path in files] == ["a.txt", "b.txt"]
    assert files[0][0] == (tmp_path / "a.txt").as_posix()


def test_a_pattern_that_matches_nothing_says_why_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.paths: .* does not exist.*check the path"):
        user_files((str(tmp_path / "missing.txt"),))
    with pytest.raises(DataError, match="not a regular file"):
        user_files((str(tmp_path),), key="data.paths")
    with pytest.raises(DataError, match="check the directory and the pattern"):
        user_files((str(tmp_path / "*.none"),))
    with pytest.raises(DataError, match="a relative path starts from"):
        user_files(("no/such/file.txt",))


def test_the_validation_split_is_a_stable_share_of_the_keys() -> None:
    keys = [f"file{i}.py" for i in range(2000)]
    held = [k for k in keys if is_val(k, 0.1)]
    assert 150 < len(held) < 250  # about a tenth
    assert held == [k for k in keys if is_val(k, 0.1)]  # the same every time
    assert not any(is_val(k, 0.0) for k in keys[:50]) and all(is_val(k, 1.0) for k in keys[:50])


def test_shard_types_say_how_many_tokens_they_hold() -> None:
    assert SHARD_DTYPES == {"uint8": 256, "uint16": 65536, "uint32": 2**32}
    assert issubclass(DataError, ValueError)
