"""Real nodes on separate hosts (network namespaces), one behind NAT, joining from a run spec.

Hosts ``a``, ``b`` and ``c`` sit on one bridge, each node listening on its own address;
``d`` sits behind a NAT router (it can dial out, nobody can dial in); ``e`` is a public
host whose node runs another spec of the same run id. The bootstrap operator (on ``a``)
writes and signs the run spec; the nodes on ``b`` and ``c`` join with ``atoll run --spec``,
and the volunteer behind NAT with the run's address alone (``atoll run --join``, which
fetches the spec from the bootstrap node and checks it was signed by that node's key).
"""

from __future__ import annotations

import functools
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from node.ops import swarm
from node.run.metrics import read_events
from node.spec_file import read_spec
from tests.integration.conftest import SMALL, wait_until
from tests.netlab import NetLab
from verification.audit import AuditLog
from verification.identity import Identity

pytestmark = pytest.mark.integration

PORT = 31337  # every host has its own network stack, so one fixed port serves all
ROUNDS = 4
_COMMIT_REASONS = {"uncommitted", "late_commit", "commit_mismatch"}


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _make_spec(path: Path, key: Path, overrides: list[str], bootstrap: str) -> None:
    done = _cli(
        "spec", "create", *_sets(overrides), "--key", str(key), "--bootstrap", bootstrap,
        "--out", str(path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


class LabNodes:
    """Nodes started on a lab's hosts; always stopped."""

    def __init__(self, lab: NetLab, directory: Path) -> None:
        self.lab = lab
        self.directory = directory
        self.nodes: list[swarm.SwarmProcess] = []

    def start(
        self, index: int, host: str, overrides: list[str], args: list[str], nodes: int, rounds: int
    ) -> swarm.SwarmProcess:
        ip = self.lab.hosts[host].ip
        spec = swarm.SwarmSpec(
            nodes=nodes,
            config_paths=[],
            overrides=[*overrides, f"network.host='{ip}'", f"network.port={PORT}"],
            directory=self.directory,
            rounds=rounds,
            extra_args={index: args},
        )
        popen = functools.partial(self.lab.popen, self.lab.hosts[host])
        node = swarm.start_node(spec, index, [], popen=popen)
        self.nodes.append(node)
        return node

    def wait(self, timeout: float) -> bool:
        return wait_until(lambda: all(n.proc.poll() is not None for n in self.nodes), timeout, 1.0)

    def close(self) -> None:
        swarm.stop_all([n for n in self.nodes if not n.log.closed], grace=20)


def _shared_swarm_overrides() -> list[str]:
    return list(SMALL)


def _rounds(node: swarm.SwarmProcess) -> dict[int, dict]:
    return {e["round"]: e for e in read_events(node.data_dir / "events.jsonl", "round")}


def _audit_rows(node: swarm.SwarmProcess) -> list:
    log = AuditLog(node.data_dir / "atoll.db")
    try:
        return log.rows()
    finally:
        log.close()


@pytest.fixture(scope="module")
def spec_swarm(
    netlab_module: NetLab, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SimpleNamespace]:
    """Four nodes of one spec (one behind NAT) and one of another spec, run to the end."""
    lab = netlab_module
    for name in "abce":
        lab.add_host(name)
    lab.add_nat_host("d")
    root = tmp_path_factory.mktemp("multihost")
    # The bootstrap operator's key, made first: the spec names the bootstrap's address.
    boot_key = root / "node0" / "identity.key"
    boot_key.parent.mkdir(parents=True)
    boot = Identity.generate()
    boot.save(boot_key)
    bootstrap = f"/ip4/{lab.hosts['a'].ip}/tcp/{PORT}/p2p/{boot.peer_id}"
    shared = _shared_swarm_overrides()
    _make_spec(root / "run.toml", boot_key, shared, bootstrap)
    other = [o for o in shared if not o.startswith("sync.codec")] + ["sync.codec='int4'"]
    _make_spec(root / "other.toml", boot_key, other, bootstrap)

    nodes = LabNodes(lab, root)
    try:
        spec_args = ["--spec", str(root / "run.toml")]
        nodes.start(0, "a", shared, spec_args, nodes=4, rounds=ROUNDS)
        for index, host in ((1, "b"), (2, "c")):
            nodes.start(index, host, shared, spec_args, nodes=4, rounds=ROUNDS)
        # the volunteer behind NAT has only the run address (started with the others:
        # it keeps asking until the bootstrap node serves the spec)
        nodes.start(3, "d", shared, ["--join", f"itest@{bootstrap}"], nodes=4, rounds=ROUNDS)
        # Same run id, another spec (int4): it must be refused, and refuse the others.
        # It runs longer than the others, so it is there for all of their run.
        stranger = ["--spec", str(root / "other.toml")]
        nodes.start(4, "e", other, stranger, nodes=1, rounds=ROUNDS + 4)
        finished = nodes.wait(300)
        yield SimpleNamespace(lab=lab, root=root, nodes=nodes.nodes, finished=finished)
    finally:
        nodes.close()


def test_three_hosts_and_a_nat_host_train_and_agree_every_round(spec_swarm) -> None:
    assert spec_swarm.finished, "nodes did not finish within 300 s"
    same = spec_swarm.nodes[:4]
    # the stranger, refused by all, never exchanged: it says so and fails (below)
    assert [n.proc.returncode for n in spec_swarm.nodes] == [0] * 4 + [2]
    rounds = [_rounds(n) for n in same]
    assert all(sorted(r) == list(range(1, ROUNDS + 1)) for r in rounds)
    for r in range(1, ROUNDS + 1):  # bitwise agreement, every round
        assert len({rs[r]["global_digest"] for rs in rounds}) == 1, f"round {r} differs"
    first = same[0].status["val_bpb_start"]
    assert rounds[0][ROUNDS]["val_bpb"] < first - 1.0  # it learned
    for node in same:
        refused = [row for row in _audit_rows(node) if row.reason in _COMMIT_REASONS]
        assert refused == [], f"node {node.index} refused parts: {refused[:3]}"
        for sync in read_events(node.data_dir / "events.jsonl", "sync"):
            assert sync["complete"], sync


def test_a_volunteer_behind_nat_joins_from_the_run_address_alone(spec_swarm) -> None:
    nat, boot = spec_swarm.nodes[3], spec_swarm.nodes[0]
    fetched = nat.data_dir / "run-spec.toml"
    spec = read_spec(fetched, operator=boot.status["peer_id"])  # kept, and it verifies
    assert spec.digest == read_spec(spec_swarm.root / "run.toml").digest
    assert nat.status["spec"] == boot.status["spec"] == spec.digest
    log = (nat.data_dir / "node.log").read_text()
    assert f"a copy is in {fetched}" in log
    assert nat.proc.returncode == 0 and _rounds(nat)
    # its join figures: the tries its start took, and its first contribution's time
    assert nat.status["join_attempts"] >= 1 and nat.status["relayed"] is False
    first = [
        e for e in read_events(nat.data_dir / "events.jsonl") if e["event"] == "first_exchange"
    ]
    assert len(first) == 1 and 0 < first[0]["seconds"] == nat.status["first_exchange_s"] < 300


def test_nat_node_contributes_every_round_owns_no_part_and_says_unreachable(spec_swarm) -> None:
    nat = spec_swarm.nodes[3]
    me = nat.status["peer_id"]
    assert nat.status["reachability"]["status"] == "private"
    syncs = read_events(nat.data_dir / "events.jsonl", "sync")
    assert syncs and all(me not in s["owners"] and me in s["group"] for s in syncs)
    # The owners' audit rows show its tokens in every round, and it audited nothing itself.
    for r in range(1, ROUNDS + 1):
        rows = [row for n in spec_swarm.nodes[:3] for row in _audit_rows(n) if row.round == r]
        mine = [row for row in rows if row.sender == me]
        assert mine and all(row.verdict == "accepted" and row.tokens > 0 for row in mine), r
    assert _audit_rows(nat) == []
    for n in spec_swarm.nodes[:3]:  # the others know it as a client
        assert n.status["reachability"]["status"] == "public"
    shown = _cli("status", "--data-dir", str(nat.data_dir))
    assert shown.returncode == 0 and "reachability: NOT reachable" in shown.stdout
    assert str(PORT) in shown.stdout  # names the port to open


def test_a_peer_on_another_spec_is_refused_and_shown_with_the_reason(spec_swarm) -> None:
    stranger = spec_swarm.nodes[4]
    them = stranger.status["peer_id"]
    for node in spec_swarm.nodes[:4]:
        refused = node.status.get("refused_peers", {})
        assert refused.get(them, "").startswith("spec_mismatch"), (node.index, refused)
        logged = read_events(node.data_dir / "events.jsonl", "peer_refused")
        assert [e["peer"] for e in logged].count(them) == 1  # one line, not one per round
        for sync in read_events(node.data_dir / "events.jsonl", "sync"):
            assert them not in sync["group"]
    own = read_events(stranger.data_dir / "events.jsonl", "sync")
    assert own and all(s["group"] == [them] for s in own)  # it trained alone
    # said at WARN after network.alone_rounds, then an error: its work reached no one
    assert read_events(stranger.data_dir / "events.jsonl", "alone")
    said = (stranger.data_dir / "node.log").read_text()
    assert "atoll: trained" in said and "without one exchange with a peer" in said
    assert "peer(s) refused as on another spec" in said
    # and refuses the others it has read a record of (the DHT may not show it all four)
    theirs = stranger.status.get("refused_peers", {})
    others = {n.status["peer_id"] for n in spec_swarm.nodes[:4]}
    assert theirs and set(theirs) <= others, theirs
    assert all(r.startswith("spec_mismatch") for r in theirs.values()), theirs
    shown = _cli("status", "--data-dir", str(spec_swarm.nodes[0].data_dir))
    assert f"refused peer {them}: spec_mismatch" in shown.stdout


def test_config_that_differs_from_the_spec_is_refused_at_start(spec_swarm, tmp_path) -> None:
    done = _cli(
        "run", "--spec", str(spec_swarm.root / "run.toml"), "--data-dir", str(tmp_path / "n"),
        "--set", "sync.codec='int4'",
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "sync.codec" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "n").exists()  # refused before anything was made


def test_two_nodes_with_one_key_the_second_refuses_to_start(netlab_module, tmp_path) -> None:
    lab = netlab_module
    for name in ("x", "y", "z"):
        lab.add_host(name)
    nodes = LabNodes(lab, tmp_path)
    try:
        # rounds=0: no round limit; they run until stopped
        overrides = [*SMALL, "run.run_id='twins'"]
        boot = nodes.start(0, "x", overrides, [], nodes=2, rounds=0)
        maddrs = swarm.wait_for_maddrs(boot)
        first = nodes.start(1, "y", overrides, ["--initial-peers", *maddrs], nodes=2, rounds=0)
        assert wait_until(lambda: first.status.get("round", 0) >= 1, 90)
        twin_dir = tmp_path / "node2"
        twin_dir.mkdir()
        shutil.copy2(first.data_dir / "identity.key", twin_dir / "identity.key")  # copied dir
        twin = nodes.start(2, "z", overrides, ["--initial-peers", *maddrs], nodes=2, rounds=0)
        assert wait_until(lambda: twin.proc.poll() is not None, 60), "the twin kept running"
        assert twin.proc.returncode == 2
        log = (twin.data_dir / "node.log").read_text()
        # found by the registry record, or earlier by the DHT's dial-back while joining
        assert f"another node is running with the identity key {twin_dir / 'identity.key'}" in log
        assert first.proc.poll() is None and boot.proc.poll() is None  # the others go on
    finally:
        nodes.close()


@pytest.mark.exclusive  # a busy share of at least 0.95
def test_a_host_on_a_capped_link_does_not_slow_the_others(netlab_module, tmp_path) -> None:
    lab = netlab_module
    for name in ("f", "g", "h"):
        lab.add_host(name)
    cap_mbit = 20.0
    lab.shape(lab.hosts["h"], cap_mbit)
    boot_key = tmp_path / "node0" / "identity.key"
    boot_key.parent.mkdir(parents=True)
    boot = Identity.generate()
    boot.save(boot_key)
    bootstrap = f"/ip4/{lab.hosts['f'].ip}/tcp/{PORT}/p2p/{boot.peer_id}"
    # Wall-clock rounds, uncompressed parts of a larger model: a sync moves ~1.3 MB per
    # node, which the capped link needs half a second or more for.
    overrides = [o for o in SMALL if o.split("=")[0] not in ("sync.trigger", "sync.codec")]
    overrides += [
        "run.run_id='capped'",
        "sync.trigger='seconds'",
        "sync.round_seconds=8",
        "network.matchmaking_seconds=1.5",
        "sync.codec='none'",
        "model.n_embd=128",
        "model.n_layer=2",
    ]
    spec = tmp_path / "run.toml"
    t0 = time.time() + 30  # round 1 starts once every node is up
    done = _cli(
        "spec", "create", *_sets(overrides), "--key", str(boot_key), "--bootstrap", bootstrap,
        "--t0", str(t0), "--out", str(spec),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    nodes = LabNodes(lab, tmp_path)
    try:
        for index, host in enumerate("fgh"):
            nodes.start(index, host, overrides, ["--spec", str(spec)], nodes=3, rounds=ROUNDS)
        assert nodes.wait(240), "nodes did not finish"
        fast, capped = nodes.nodes[:2], nodes.nodes[2]
        assert [n.proc.returncode for n in nodes.nodes] == [0, 0, 0]
        rounds = [_rounds(n) for n in nodes.nodes]
        for r in range(1, ROUNDS + 1):
            assert len({rs[r]["global_digest"] for rs in rounds}) == 1, f"round {r} differs"
        for node in fast:
            busy, idle = node.status["busy_seconds"], node.status["idle_seconds"]
            assert busy / (busy + idle) >= 0.95, (node.index, busy, idle)
        # The cap was in force: each of the capped node's syncs took at least as long as
        # its own bytes need on a 20 Mbit/s link.
        syncs = read_events(capped.data_dir / "events.jsonl", "sync")
        assert len(syncs) == 2 * ROUNDS
        needed = statistics.median(s["bytes_sent"] * 8 / (cap_mbit * 1e6) for s in syncs)
        took = statistics.median(s["seconds"] for s in syncs)
        assert took >= 0.8 * needed and needed > 0.3, (took, needed)
    finally:
        nodes.close()
