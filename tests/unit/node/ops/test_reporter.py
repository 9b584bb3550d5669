"""What a node says about itself before and after its parts exist, and its upkeep's
report: refused peers said once, the warning on control silence at most once a minute."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

from node.ops.reporter import Reporter, Upkeep
from node.run.metrics import EventLog, StatusWriter
from node.run.state import Progress
from node.train.agreement import AgreementWatch


def _reporter(tmp_path) -> Reporter:
    status = StatusWriter(tmp_path / "status.json", min_interval=0)
    progress = Progress()
    progress.clock.finish(3)
    return Reporter("run", "spec", progress, status, tmp_path)


def test_a_node_still_starting_reports_what_it_has(tmp_path) -> None:
    reporter = _reporter(tmp_path)
    reporter.status.update(force=True, state="starting")
    vitals = reporter.vitals()
    assert vitals["round"] == 3 and vitals["step"] == 0 and vitals["device"] == ""
    assert vitals["digest"] is None and vitals["reachable"] is True
    state = reporter.monitor_state()
    assert state["state"] == "starting" and state["run_id"] == "run"
    assert "syncs" not in state and "checkpoint_age_seconds" not in state


def test_vitals_carry_the_throughput_and_the_last_global_digest(tmp_path) -> None:
    reporter = _reporter(tmp_path)
    reporter.training = SimpleNamespace(trainer=SimpleNamespace(tokens=1000, steps=7), device="cpu")  # type: ignore[assignment]
    reporter.progress.busy = 4.0
    reporter.progress.global_digest = (3, "ab")
    vitals = reporter.vitals()
    assert vitals["throughput"] == 250.0 and vitals["step"] == 7 and vitals["device"] == "cpu"
    assert vitals["digest"] == [3, "ab"]


class _Control:
    addrs = ["/ip4/127.0.0.1/tcp/1"]

    def __init__(self) -> None:
        self.warning = "no heartbeat heard from 2 live peers"

    def heard(self) -> dict:
        return {"peerA": {"digest": [3, "cd" * 32]}, "peerC": {"digest": "garbage"}}

    def swarm(self) -> dict:
        return {"peers": {"peerA": {}}}

    def silence(self, live: set[str]) -> str:
        return self.warning


def _upkeep(tmp_path, reporter: Reporter) -> tuple[Upkeep, EventLog, AgreementWatch]:
    transport = SimpleNamespace(
        reachability=SimpleNamespace(to_dict=lambda: {"status": "public"}),
        config=SimpleNamespace(data_plane="p2pd"),
        data_port=None,
        calls_by_plane={"p2pd": 2},
    )
    network = SimpleNamespace(
        transport=transport,
        control=_Control(),
        peers=SimpleNamespace(refused=lambda: {"peerB": "other spec"}),
        syncer=SimpleNamespace(refused={}),
        verifier=SimpleNamespace(reputations=lambda: {"peerA": 1.0}),
        helper_pids=lambda: [11, 12],
    )
    events = EventLog(tmp_path / "events.jsonl")
    agreement = AgreementWatch()
    upkeep = Upkeep(network, None, reporter, events, agreement, threading.Event())  # type: ignore[arg-type]
    return upkeep, events, agreement


def test_a_refused_peer_is_logged_once_and_reported_every_time(tmp_path, caplog) -> None:
    reporter = _reporter(tmp_path)
    upkeep, events, agreement = _upkeep(tmp_path, reporter)
    with caplog.at_level(logging.WARNING):
        upkeep.report({"peerA"})
        upkeep.report({"peerA"})
    events.close()
    assert caplog.text.count("peer peerB refused: other spec") == 1
    assert (tmp_path / "events.jsonl").read_text().count("peer_refused") == 1
    status = reporter.status.current
    assert status["refused_peers"] == {"peerB": "other spec"} and status["live_peers"] == 1
    assert status["helper_pids"] == [11, 12] and status["data_plane"]["calls"] == {"p2pd": 2}
    # the silence warning is logged once within a minute, and always in the status
    assert caplog.text.count("no heartbeat heard") == 1
    assert status["control_warning"] == "no heartbeat heard from 2 live peers"
    assert upkeep.warned_at <= time.monotonic()


def test_peers_digests_heard_feed_the_agreement(tmp_path) -> None:
    reporter = _reporter(tmp_path)
    upkeep, events, agreement = _upkeep(tmp_path, reporter)
    upkeep.hear_digests()
    events.close()
    assert agreement._peers == {3: {"peerA": "cd" * 32}}  # a malformed one is ignored


def test_upkeep_ends_with_the_reason_to_stop_and_leaves_stopping_to_the_node(tmp_path) -> None:
    reporter = _reporter(tmp_path)
    upkeep, events, _ = _upkeep(tmp_path, reporter)
    conflict = "another node is running with the identity key /data/identity.key"
    upkeep.network.peers = SimpleNamespace(due=lambda: False, conflict=conflict)
    assert asyncio.run(upkeep.run()) == conflict
    events.close()
    assert not upkeep.stop.is_set()
