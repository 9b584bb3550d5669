"""The identity key file: made once, read back, and broken ones told in one line."""

from __future__ import annotations

import pytest

from node.ops.keyfile import load_identity


def test_a_key_is_made_once_and_read_back(tmp_path) -> None:
    first = load_identity(tmp_path / "identity.key")
    assert load_identity(tmp_path / "identity.key").peer_id == first.peer_id


def test_a_broken_key_or_a_directory_is_one_line_with_the_fix(tmp_path) -> None:
    (tmp_path / "identity.key").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a valid identity key .*delete it"):
        load_identity(tmp_path / "identity.key")
    (tmp_path / "dir.key").mkdir()
    with pytest.raises(ValueError, match="is a directory, not an identity key file"):
        load_identity(tmp_path / "dir.key")
