"""Operating a real node: `atoll ban` and `atoll pardon` take effect in the running node
itself (its standings, status, metrics, audit log and events), and `atoll export` takes
the agreed global parameters out of its checkpoints, of which it keeps
`run.keep_checkpoints`."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.run.metrics import read_events
from tests.integration.conftest import wait_until
from verification.audit import AuditLog

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _atoll(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=90
    )


def test_ban_and_pardon_reach_a_running_node(local_swarm):
    nodes = local_swarm.launch(2, rounds=30, extra=["run.keep_checkpoints=2", "metrics.port=0"])
    first, second = nodes
    assert wait_until(lambda: all(n.status.get("state") == "training" for n in nodes), 120)
    peer = second.status["peer_id"]
    data = str(first.data_dir)

    banned = _atoll("ban", peer, "--reason", "operator test", "--data-dir", data)
    assert banned.returncode == 0, banned.stderr
    assert f"by the running node (pid {first.proc.pid})" in banned.stdout
    assert wait_until(lambda: first.status.get("flagged", {}).get(peer) == "banned", 30)
    # the metrics endpoint says so too, with the node's own progress
    url = first.status["metrics_url"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("atoll_peer_standing", (("peer", peer), ("standing", "banned")))] == 1
    assert samples[("atoll_inner_steps_total", ())] > 0
    assert samples[("atoll_peers", (("source", "dht"),))] == 1
    with urllib.request.urlopen(f"{url}/api/v1/state", timeout=10) as response:
        assert json.loads(response.read())["peer_id"] == first.status["peer_id"]

    pardoned = _atoll("pardon", peer, "--data-dir", data)
    assert pardoned.returncode == 0, pardoned.stderr
    assert wait_until(lambda: peer not in first.status.get("flagged", {}), 30)

    listed = _atoll("peers", "--json", "--data-dir", data)
    assert listed.returncode == 0, listed.stderr
    assert '"status": "ok"' in listed.stdout and peer in listed.stdout

    local_swarm.close()  # stop the run: its audit log is then flushed and closed
    events = read_events(first.data_dir / "events.jsonl")
    kinds = [(e["event"], e.get("peer")) for e in events if e["event"].startswith("operator_")]
    assert kinds == [("operator_ban", peer), ("operator_pardon", peer)]
    with AuditLog(first.data_dir / "atoll.db") as log:
        rows = [r.verdict for r in log.rows(peer=peer) if r.verdict.startswith("operator_")]
        assert log.verify()[0] is True
    assert rows == ["operator_ban", "operator_pardon"]

    # the run is over: its newest checkpoint's global parameters, as the swarm agreed them
    checkpoints = sorted((first.data_dir / "checkpoints").glob("ckpt-*.pt"))
    assert 1 <= len(checkpoints) <= 2  # run.keep_checkpoints
    out = first.data_dir / "model.safetensors"
    exported = _atoll("export", "--data-dir", data, "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        meta, names = f.metadata(), list(f.keys())
    assert meta["run_id"] == "itest" and meta["checkpoint"] == checkpoints[-1].name and names
    attested = {e["round"]: e["global_digest"] for e in events if e["event"] == "round"}
    assert meta["global_digest"] == attested[int(meta["round"])]
