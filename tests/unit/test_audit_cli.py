"""`atoll audit show` and `atoll audit blame` as an operator uses them."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.cli import main
from verification.audit import AuditLog
from verification.identity import Identity

A = Identity.from_seed(b"a" * 32).peer_id
B = Identity.from_seed(b"b" * 32).peer_id


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    with AuditLog(tmp_path / "atoll.db") as log:
        for peer in (A, B, A):
            log.append(
                round=1,
                fragment=0,
                part=0,
                sender=peer,
                digest="ab" * 32,
                tokens=5,
                verdict="accepted",
            )
    return tmp_path


def test_show_takes_the_shortened_peer_id_it_prints(data_dir: Path, capsys) -> None:
    assert main(["audit", "show", "--data-dir", str(data_dir)]) == 0
    shown = capsys.readouterr().out.splitlines()[1].split()[4]  # "...<last 13 characters>"
    assert shown.startswith("...") and A.endswith(shown[3:])
    for typed in (shown, A):
        assert main(["audit", "show", "--peer", typed, "--json", "--data-dir", str(data_dir)]) == 0
        assert capsys.readouterr().out.count(A) == 2


def test_show_says_when_a_short_peer_id_is_unknown_or_ambiguous(data_dir: Path, capsys) -> None:
    assert main(["audit", "show", "--peer", "...zzzz", "--data-dir", str(data_dir)]) == 2
    assert "no sender in the audit log ends with 'zzzz'" in capsys.readouterr().err
    # "..." alone ends every PeerID: both senders match
    assert main(["audit", "show", "--peer", "...", "--data-dir", str(data_dir)]) == 2
    assert "matches 2 senders" in capsys.readouterr().err


def test_blame_of_a_round_without_rows_says_so(data_dir: Path, capsys) -> None:
    assert main(["audit", "blame", "--round", "9", "--data-dir", str(data_dir)]) == 0
    assert "round 9: no rows in this node's audit log" in capsys.readouterr().out
    assert main(["audit", "blame", "--round", "1", "--data-dir", str(data_dir)]) == 0
    assert "accepted   2" in capsys.readouterr().out
