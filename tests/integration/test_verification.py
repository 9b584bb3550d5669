"""Five real nodes, one of them faulty: defences, quarantine, trust policy, audit log."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from node.run.metrics import read_events
from node.swarm.byzantine import MODES
from tests.integration.conftest import Swarm
from verification.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NODES, ROUNDS = 5, 3
GROUP = ["network.group_size=5"]
# Screens cannot see these by design: zero is an idle node, ALIE hides inside the spread.
INVISIBLE = {"zero", "alie"}


def _run(swarm: Swarm, extra: list[str] = (), mode: str | None = None) -> dict:
    args = {NODES - 1: ["--byzantine", mode]} if mode else {}
    swarm.launch(NODES, ROUNDS, GROUP + list(extra), args)
    assert swarm.wait_all(280), "swarm did not finish"
    return swarm.summary()


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    swarm = Swarm(tmp_path_factory.mktemp("clean") / "swarm")
    try:
        summary = _run(swarm)
        summary["dirs"] = [n.data_dir for n in swarm.nodes]
    finally:
        swarm.close()
    assert not swarm.leftovers()
    return summary


def test_clean_run_flags_no_one_and_agrees(clean):
    assert clean["exit_codes"] == [0] * NODES, clean["failed_nodes"]
    assert clean["params_agree"], clean["rounds_disagreeing"]
    assert clean["val_bpb_end"] < clean["val_bpb_start"] - 1.5
    assert all(flagged == {} for flagged in clean["flagged"].values()), clean["flagged"]
    for d in clean["dirs"]:
        assert read_events(d / "events.jsonl", "violation") == []


# 12 swarms of 5 nodes (about 9 minutes here): run by `make test-all`. Each passed in two
# standalone runs of the whole file on this 2-core machine; in full-suite runs a transient
# stream loss under load has failed one mode in some runs.
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_one_byzantine_node_is_contained(mode, clean, local_swarm):
    summary = _run(local_swarm, mode=mode)
    honest = local_swarm.nodes[: NODES - 1]
    attacker = local_swarm.nodes[NODES - 1].status["peer_id"]
    assert [n.proc.returncode for n in honest] == [0] * (NODES - 1)
    assert summary["params_agree"], summary["rounds_disagreeing"]
    assert summary["val_bpb_end"] <= clean["val_bpb_end"] * 1.05, (
        summary["val_bpb_end"],
        clean["val_bpb_end"],
    )
    honest_ids = {n.status["peer_id"] for n in honest}
    for node in honest:
        flagged = summary["flagged"][str(node.index)]
        assert not honest_ids & set(flagged), f"an honest peer was flagged: {flagged}"
        if mode not in INVISIBLE:
            assert flagged.get(attacker) in ("quarantined", "banned"), (mode, flagged)
            first = min(
                e["round"]
                for e in read_events(node.data_dir / "events.jsonl", "violation")
                if e["peer"] == attacker
            )
            assert first <= 3


@pytest.mark.slow  # the control of the matrix above, in make test-all with it
def test_without_defences_the_same_attack_hurts(clean, local_swarm):
    undefended = ["trust.aggregator='mean'", "trust.screening=false"]
    summary = _run(local_swarm, undefended, mode="scale")
    assert summary["val_bpb_end"] > clean["val_bpb_end"] * 1.10, (
        summary["val_bpb_end"],
        clean["val_bpb_end"],
    )


def test_audit_verify_passes_then_catches_edits_and_deletions(clean, tmp_path):
    source = clean["dirs"][0]
    cli = [sys.executable, "-m", "node.cli", "audit", "verify", "--data-dir"]
    ok = subprocess.run(cli + [str(source)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "audit log OK" in ok.stdout
    for name, sql, row in (
        ("edited", "UPDATE audit SET tokens = tokens + 1 WHERE id = 5", 5),
        ("deleted", "DELETE FROM audit WHERE id = 7", 8),
    ):
        copy = tmp_path / name
        copy.mkdir()
        shutil.copy(source / "atoll.db", copy / "atoll.db")
        with sqlite3.connect(copy / "atoll.db") as conn:
            conn.execute(sql)
        bad = subprocess.run(cli + [str(copy)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1, bad.stdout
        assert f"row {row}" in bad.stdout


def test_strict_policy_refuses_a_peer_not_on_its_allow_list(local_swarm):
    base = local_swarm.directory
    keys = [Identity.generate() for _ in range(3)]
    for i, key in enumerate(keys):
        (base / f"node{i}").mkdir(parents=True)
        key.save(base / f"node{i}" / "identity.key")
    strict = [f"trust.allow=['{keys[1].peer_id}']", "trust.accept_unknown=false"]
    nodes = [local_swarm.start_one(0, 1, extra=strict, nodes=3)]
    from node.ops.swarm import wait_for_maddrs

    peers = wait_for_maddrs(nodes[0])
    for i in (1, 2):
        nodes.append(local_swarm.start_one(i, 1, peers=peers, nodes=3))
    assert local_swarm.wait_all(200)
    assert [n.proc.returncode for n in nodes] == [0, 0, 0]
    from verification.audit import AuditLog

    log = AuditLog(base / "node0" / "atoll.db")
    try:
        from_outsider = log.rows(peer=keys[2].peer_id)
        # its parts refused as owner, and its reduced parts refused as member
        assert {r.verdict for r in from_outsider} == {"rejected", "owner_rejected"}
        assert {r.reason for r in from_outsider} == {"not_allowed"}
        assert any(r.verdict == "accepted" for r in log.rows(peer=keys[1].peer_id))
    finally:
        log.close()
    assert "not_allowed" in (base / "node0" / "node.log").read_text()


def test_policy_files_layer_over_a_node_config():
    from node.config import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    cfg = load_config([root / "local-swarm.toml", root / "trust" / "strict.toml"])
    assert cfg.trust.aggregator == "trimmed_mean" and cfg.sync.codec == "int8"
