"""`atoll status`, `atoll audit show` and `atoll audit blame` as an operator uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.cli import main
from verification.audit import AuditLog
from verification.identity import Identity

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
        "alone_syncs": 4,
        "alone_warning": "round 3 fragment 1: averaged alone while 2 peer(s) are live",
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
    assert "WARNING: 4 sync(s) averaged alone while peers were live; last: round 3" in out
    assert "no (client)" in out


def test_a_stale_status_is_marked_with_its_age(tmp_path: Path, capsys, monkeypatch) -> None:
    import time

    monkeypatch.setenv("COLUMNS", "160")
    swarm = {"peers": {PEER: {"round": 6, "step": 3, "last_seen_s": 0.1}}}
    now = time.time()
    # the command reads the clock once: pin it, so a slow machine cannot age the status
    monkeypatch.setattr("node.cli.operating.time.time", lambda: now)
    _write(tmp_path, updated=now - 169, swarm=swarm)
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "STALE: this status is 169 s old" in out and "last state was training" in out
    # a peer last heard 0.1 s before the status was written was heard 169 s ago
    assert "169.1 s ago" in out and "0.1 s ago" not in out


def test_a_fresh_status_and_a_stopped_node_are_not_stale(tmp_path: Path, capsys) -> None:
    import time

    _write(tmp_path, updated=time.time() - 1)
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    assert "STALE" not in capsys.readouterr().out
    _write(tmp_path, state="stopped", updated=time.time() - 3600)
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "STALE" not in out and "state stopped" in out and "written 3600" in out


def test_status_shows_the_nodes_own_progress_and_flagged_peers(tmp_path: Path, capsys) -> None:
    fields = {
        "params": 478_720,
        "step": 420,
        "loss": 2.5,
        "val_bpb": 3.125,
        "tokens": 99_000,
        "bytes_sent": 3 * 2**20,
        "flagged": {PEER: "banned"},
    }
    assert main(["status", "--data-dir", str(_write(tmp_path, **fields))]) == 0
    out = capsys.readouterr().out
    assert "model 0.48 M parameters  step 420  loss 2.500  val bits/byte 3.125" in out
    assert "tokens 99000  sent 3.0 MiB" in out
    assert f"flagged peers: {PEER} (banned)" in out
    assert main(["status", "--data-dir", str(_write(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert (
        "model - parameters  step -  loss -  val bits/byte -" in out
        and "flagged peers: none" in out
    )


def test_status_says_how_the_node_joined(tmp_path: Path, capsys) -> None:
    fields = {
        "state": "training",
        "join_attempts": 3,
        "first_exchange_s": 14.24,
        "catch_ups": 1,
        "catch_up_bytes": 3 * 2**19,
        "catch_up_seconds": 0.4,
    }
    assert main(["status", "--data-dir", str(_write(tmp_path, **fields))]) == 0
    out = capsys.readouterr().out
    assert (
        "joining: reached a peer on try 3; first exchange 14.2 s after launch; took the "
        "swarm's state 1 time(s): 1.5 MiB in 0.4 s"
    ) in out
    assert main(["status", "--data-dir", str(_write(tmp_path, state="training"))]) == 0
    assert "joining: no exchange with a peer yet" in capsys.readouterr().out
    assert main(["status", "--data-dir", str(_write(tmp_path, state="stopped"))]) == 0
    assert "joining:" not in capsys.readouterr().out


def test_a_peer_not_judged_yet_shows_the_stores_starting_score(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from verification.reputation import INITIAL_SCORE, ReputationStore

    monkeypatch.setenv("COLUMNS", "160")
    store = ReputationStore(tmp_path / "atoll.db")
    try:
        assert store.standing(PEER, 0).score == INITIAL_SCORE == 0.5
    finally:
        store.close()
    swarm = {"peers": {PEER: {"round": 6, "step": 3, "last_seen_s": 0.5}}}
    assert main(["status", "--data-dir", str(_write(tmp_path, swarm=swarm))]) == 0
    assert "0.50 ok" in capsys.readouterr().out


def test_version(capsys) -> None:
    import importlib.metadata

    import pytest

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"atoll {importlib.metadata.version('atoll')}"


def test_status_says_where_the_node_listens_and_how_another_joins(tmp_path: Path, capsys) -> None:
    maddrs = ["/ip4/192.0.2.7/tcp/31337"]
    assert main(["status", "--data-dir", str(_write(tmp_path, maddrs=maddrs))]) == 0
    out = capsys.readouterr().out
    full = "/ip4/192.0.2.7/tcp/31337/p2p/12D3KooWme"
    assert f"listens on {full}" in out
    assert f"another node joins with: atoll run --initial-peers {full}" in out


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


@pytest.mark.parametrize(
    ("deadlines", "line"),
    [
        (
            {"adaptive": True, "exchange_seconds": 65.0, "measured_p90": None, "backoff": 1},
            "exchange budget 65.0 s (configured, until 4 exchanges completed)",
        ),
        (
            {"adaptive": True, "exchange_seconds": 13.0, "measured_p90": 0.6, "backoff": 1},
            "exchange budget 13.0 s (measured: 90 % of exchanges within 0.6 s)",
        ),
        (
            {"adaptive": True, "exchange_seconds": 26.0, "measured_p90": 0.6, "backoff": 2},
            "exchange budget 26.0 s (measured: 90 % of exchanges within 0.6 s, x2 after",
        ),
        (
            {"adaptive": False, "exchange_seconds": 65.0, "measured_p90": None, "backoff": 1},
            "exchange budget 65.0 s (configured; network.adaptive_deadlines is off)",
        ),
    ],
)
def test_status_shows_the_exchange_budget_and_where_it_comes_from(
    tmp_path: Path, capsys, deadlines: dict, line: str
) -> None:
    _write(tmp_path, spec="ab" * 32, deadlines=deadlines)
    assert main(["status", "--data-dir", str(tmp_path)]) == 0
    assert line in capsys.readouterr().out
