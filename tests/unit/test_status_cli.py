"""`atoll status`: the swarm as a node's status file describes it."""

from __future__ import annotations

import json
from pathlib import Path

from node.cli import main

PEER = "12D3KooWPKQ3csLUY6NdyC2WjfCLkaTUSPoEmrY46fYwabtZDpbZ"


def _write(tmp_path: Path, **fields) -> Path:
    status = {"peer_id": "12D3KooWme", "state": "training", "round": 7, "pid": 1, **fields}
    (tmp_path / "status.json").write_text(json.dumps(status))
    return tmp_path


def test_status_lists_peers_from_heartbeats(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # rich sizes its table to the terminal
    swarm = {
        "peers": {
            PEER: {
                "version": "0.1.0",
                "round": 6,
                "step": 300,
                "throughput": 1234.5,
                "last_seen_s": 0.7,
            }
        },
        "sidecar_pid": 42,
        "sidecar_restarts": 1,
        "dropped": {"bad_signature": 2},
        "verdicts": 3,
        "forged_verdicts": 1,
    }
    reputations = {PEER: {"score": 0.25, "status": "quarantined", "violations": 2}}
    assert (
        main(["status", "--data-dir", str(_write(tmp_path, swarm=swarm, reputations=reputations))])
        == 0
    )
    out = capsys.readouterr().out
    assert "round 7" in out and PEER[-12:] in out and "0.1.0" in out and "1234" in out
    assert "0.25 quarantined" in out
    assert "restarts 1" in out and "ignored: 1" in out and "dropped 2" in out


def test_status_json_is_the_whole_status(tmp_path: Path, capsys) -> None:
    assert main(["status", "--json", "--data-dir", str(_write(tmp_path, swarm={"peers": {}}))]) == 0
    assert json.loads(capsys.readouterr().out)["round"] == 7


def test_status_without_a_control_channel_says_so(tmp_path: Path, capsys) -> None:
    assert main(["status", "--data-dir", str(_write(tmp_path))]) == 0
    assert "no control channel" in capsys.readouterr().out


def test_status_of_a_directory_without_a_node_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code = main(["status", "--data-dir", str(tmp_path / "nothing")])
    assert code != 0
    assert "no status at" in capsys.readouterr().err


def test_status_shows_reachability_spec_refused_peers_and_warnings(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    status = {
        "peer_id": "12D3KooWme",
        "state": "training",
        "round": 3,
        "reachability": {"status": "private", "summary": "NOT reachable: peers see this node"},
        "spec": "ab" * 32,
        "spec_file": True,
        "live_peers": 3,
        "refused_peers": {"12D3KooWother": "spec_mismatch: runs spec 0123, this node runs abab"},
        "control_warning": "the control channel hears none of the 3 live peers",
        "swarm": {
            "peers": {
                "12D3KooWpeer": {"round": 3, "step": 9, "reachable": False, "last_seen_s": 1.0}
            }
        },
    }
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reachability: NOT reachable" in out
    assert f"run spec {'ab' * 6}; live peers 3" in out
    assert "refused peer 12D3KooWother: spec_mismatch" in out
    assert "WARNING: the control channel hears none" in out
    assert "no (client)" in out
