"""Operator commands: `atoll peers`, `atoll ban`, `atoll pardon`, for a node that runs
(through its admin folder) and one that does not (its files directly)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from node.cli import main
from node.run.admin import ADMIN_DIR, AdminInbox, Command
from verification.audit import AuditLog
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.reputation import ReputationStore
from verification.verifier import Verifier

PEER = Identity.from_seed(b"p" * 32).peer_id
ME = Identity.from_seed(b"m" * 32).peer_id


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    ReputationStore(tmp_path / "atoll.db").close()  # a node that ran once
    return tmp_path


def _peers(data_dir: Path, capsys) -> dict[str, dict]:
    assert main(["peers", "--json", "--data-dir", str(data_dir)]) == 0
    return {row["peer"]: row for row in json.loads(capsys.readouterr().out)}


def test_ban_and_pardon_a_stopped_node_change_its_files_and_its_audit_log(
    data_dir: Path, capsys
) -> None:
    assert _peers(data_dir, capsys) == {}
    assert main(["ban", PEER, "--reason", "spam parts", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "banned" in out and "it is not running" in out
    assert _peers(data_dir, capsys)[PEER]["status"] == "banned"
    assert main(["pardon", PEER, "--data-dir", str(data_dir)]) == 0
    capsys.readouterr()
    row = _peers(data_dir, capsys)[PEER]
    assert (row["status"], row["reason"]) == ("ok", "pardoned by the operator")
    with AuditLog(data_dir / "atoll.db") as log:
        rows = [(r.verdict, r.sender, r.reason) for r in log.rows()]
        assert log.verify()[0] is True  # the chain still holds
    assert rows == [
        ("operator_ban", PEER, "spam parts"),
        ("operator_pardon", PEER, "pardoned by the operator"),
    ]


def test_bad_commands_are_clear_errors_and_change_nothing(data_dir: Path, capsys) -> None:
    assert main(["ban", "not-a-peer", "--reason", "x", "--data-dir", str(data_dir)]) == 2
    assert "is not a PeerID" in capsys.readouterr().err
    assert main(["ban", PEER, "--reason", " ", "--data-dir", str(data_dir)]) == 2
    assert "give a reason" in capsys.readouterr().err
    assert main(["ban", PEER, "--reason", "x", "--data-dir", str(data_dir / "none")]) == 2
    assert "no node data in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ban", PEER, "--data-dir", str(data_dir)])  # --reason is required
    capsys.readouterr()
    assert _peers(data_dir, capsys) == {}


def _as_running(data_dir: Path) -> None:
    status = {"state": "training", "pid": os.getpid(), "updated": time.time()}
    (data_dir / "status.json").write_text(json.dumps(status))


def test_a_running_node_takes_the_command_through_its_admin_folder(data_dir: Path, capsys) -> None:
    _as_running(data_dir)
    verifier = Verifier(TrustPolicy(), data_dir / "atoll.db", ME)
    inbox = AdminInbox(data_dir, lambda c: verifier.operator(c.op, c.peer, c.reason))
    stop = threading.Event()

    def node() -> None:  # the node looks every registry_seconds; here every 50 ms
        for _ in range(400):
            if stop.is_set():
                return
            inbox.poll()
            time.sleep(0.05)

    thread = threading.Thread(target=node)
    thread.start()
    try:
        code = main(["ban", PEER, "--reason", "flooding", "--data-dir", str(data_dir)])
    finally:
        stop.set()
        thread.join(30)
    try:
        assert code == 0
        assert f"by the running node (pid {os.getpid()})" in capsys.readouterr().out
        assert verifier.blocks(PEER, verifier.clock.current + 1) == "banned"
        assert list((data_dir / ADMIN_DIR).iterdir()) == []  # nothing left behind
        # answered means written: `atoll peers` reads the file while the node still runs
        assert _peers(data_dir, capsys)[PEER]["status"] == "banned"
    finally:
        verifier.close()


def test_a_node_that_does_not_take_the_command_leaves_it_queued(data_dir: Path, capsys) -> None:
    _as_running(data_dir)
    args = ["ban", PEER, "--reason", "x", "--timeout", "0.3", "--data-dir", str(data_dir)]
    assert main(args) == 2
    assert "stays queued" in capsys.readouterr().err
    (queued,) = (data_dir / ADMIN_DIR).glob("*.json")
    # applied once the node looks, exactly once
    applied: list[Command] = []
    inbox = AdminInbox(data_dir, lambda c: applied.append(c) or {"status": "banned"})
    assert inbox.poll() == 1 and inbox.poll() == 0
    assert applied == [Command("ban", PEER, "x")]
    assert json.loads(queued.with_suffix(".done").read_text())["ok"] is True


def test_a_malformed_command_file_is_answered_not_applied(tmp_path: Path) -> None:
    folder = tmp_path / ADMIN_DIR
    folder.mkdir()
    (folder / "1.json").write_text('{"op": "delete_everything", "peer": "x", "reason": "y"}')
    (folder / "2.json").write_bytes(b"\xff not json")
    applied: list[Command] = []
    inbox = AdminInbox(tmp_path, lambda c: applied.append(c) or {})
    assert inbox.poll() == 2
    assert applied == []
    answers = [json.loads((folder / f"{i}.done").read_text()) for i in (1, 2)]
    assert [a["ok"] for a in answers] == [False, False]
    assert "unknown command" in answers[0]["error"] and "not JSON" in answers[1]["error"]
