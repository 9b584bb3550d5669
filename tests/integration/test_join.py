"""A run address: a running node serves its run's signed spec, and a volunteer fetches it
pinned to the operator's key, on 127.0.0.1 (joining behind NAT: test_multihost.py)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from node.ops import swarm
from node.run.metrics import read_events
from node.spec_file import read_spec
from tests.integration.conftest import SMALL, Swarm, wait_until
from tests.integration.test_multihost import _cli
from verification.identity import Identity

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines, (done.returncode, done.stderr[-2000:])
    assert lines[-1].startswith("atoll: ") and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_a_node_serves_its_spec_and_a_fetch_checks_operator_run_and_reachability(
    local_swarm: Swarm, tmp_path: Path
) -> None:
    """The operator's first spec names a second key, which signs the version the node
    runs (a rotated key): the address still names the first, and pins it."""
    key = local_swarm.directory / "node0" / "identity.key"
    key.parent.mkdir(parents=True)
    operator, rotated = Identity.generate(), Identity.generate()
    operator.save(key)
    rotated.save(tmp_path / "rotated.key")
    port = _free_port()
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{operator.peer_id}"
    first, spec_file = tmp_path / "run-1.toml", tmp_path / "run.toml"
    sets = [a for o in SMALL for a in ("--set", o)]
    signers = ["--set", f"run.spec_signers=['{rotated.peer_id}']"]
    made = _cli("spec", "create", *sets, *signers, "--key", str(key), "--bootstrap", maddr,
                "--out", str(first))  # fmt: skip
    assert made.returncode == 0, made.stderr
    address = f"itest@{maddr}"
    assert f"run address: {address}" in made.stdout
    assert f"atoll join {address}" in made.stdout
    made = _cli("spec", "create", *sets, *signers, "--set", "outer.lr=0.5", "--key",
                str(tmp_path / "rotated.key"), "--bootstrap", maddr, "--previous", str(first),
                "--out", str(spec_file))  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "version 2 of run 'itest'" in made.stdout and "outer.lr: " in made.stdout
    assert f"run address: {address}" in made.stdout  # the address pins the first key still
    spec = local_swarm.spec(1, 0, [f"network.port={port}"], {0: ["--spec", str(spec_file)]})
    node = swarm.start_node(spec, 0, [])
    local_swarm.nodes.append(node)
    assert wait_until(lambda: node.status.get("state") in ("ready", "training"), 90)
    said = [e for e in read_events(node.data_dir / "events.jsonl") if e["event"] == "spec_version"]
    assert said and "changed: outer.lr: " in said[0]["line"], said

    # the spec from the swarm: verified, pinned to the address's key, written as served
    out = tmp_path / "fetched.toml"
    done = _cli("spec", "fetch", address, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert read_spec(out, operator=operator.peer_id).digest == read_spec(spec_file).digest
    assert read_spec(out).creator == rotated.peer_id

    # a volunteer told another operator refuses the operator's own spec
    someone = Identity.generate().peer_id
    line = _one_line(_cli("spec", "fetch", address, "--out", str(tmp_path / "x.toml"),
                          "--operator", someone))  # fmt: skip
    assert f"signed by {rotated.peer_id}, not by the operator {someone}" in line
    # another run's id at the same node: refused by the node, not retried
    line = _one_line(_cli("spec", "fetch", f"other@{maddr}", "--out", str(tmp_path / "y.toml")))
    assert "wrong_run" in line and "'other'" in line
    assert not (tmp_path / "x.toml").exists() and not (tmp_path / "y.toml").exists()

    # a node nobody answers at: one line, nothing started, nothing written
    closed = f"itest@/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{operator.peer_id}"
    data_dir = tmp_path / "volunteer"
    done = _cli("join", closed, "--data-dir", str(data_dir), "--set", "network.join_timeout=0")
    line = _one_line(done)
    assert "did not answer" in line and closed in line
    assert not data_dir.exists()
    assert node.proc.poll() is None  # the serving node went on meanwhile
