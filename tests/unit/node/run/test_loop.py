"""The training loop over a schedule: which syncs start with which tokens, which
results are applied, and how each round ends (on stand-ins for the trainer, the syncer
and the round's end: the loop's own decisions are what is tested)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.config import load_config
from node.data.corpus import BatchStream, assigned_stream
from node.run.metrics import EventLog, StatusWriter, read_events
from node.run.resync import Resync
from node.run.state import Progress, Running, Training
from node.settings import loop_settings, round_settings
from node.train.clock import SecondsClock
from node.train.deadlines import MIN_SAMPLES, SLACK_SECONDS, Deadlines
from node.train.schedule import StepSchedule, SyncBook, WallSchedule
from node.train.site_leader import NoSite


class _Trainer:
    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.ranks = 1
        self.optimizer = None
        self.stream = BatchStream(torch.arange(200) % 7, 2, 4, "start")
        self.trained: list[tuple[int, int]] = []
        """(step, the first value of the batch it drew)"""

    def draw_from(self, stream: BatchStream) -> None:
        self.stream = stream

    def step(self) -> Any:
        self.steps += 1
        self.tokens += 8
        inputs, _ = self.stream.next()
        self.trained.append((self.steps, int(inputs[0, 0])))
        return SimpleNamespace(tokens=8, loss=1.0)  # one batch of 2 windows of 4


class _Syncer:
    def __init__(self, fragments: int) -> None:
        self.missed = [0] * fragments
        self.refused: dict[str, str] = {}
        self.launched: list[tuple[int, int, int]] = []
        self.claims: list[Any] = []
        self.budgets: list[float] = []
        self.group = ["me", "peer"]
        self.fail: set[tuple[int, int]] = set()

    def skipped(self, f: int) -> None:
        self.missed[f] += 1

    def launch(self, r: int, f: int, tokens: int, steps: int, *rest: Any) -> Any:
        self.launched.append((r, f, tokens))
        self.claims.append(rest[-1])
        self.budgets.append(rest[-2])
        future: Future = Future()
        future.set_result(None)
        return SimpleNamespace(
            round=r, fragment=f, tokens=tokens, step=steps, future=future, deadline=0.0
        )

    def apply(self, pending: Any, steps: int) -> dict[str, Any] | None:
        if (pending.round, pending.fragment) in self.fail:
            return None
        return {"bytes_sent": 10, "group": list(self.group), "fallback_parts": 0}


class _Rounds:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.ended: list[tuple[int, bool, bool]] = []
        self.drops = False  # whether a joining round's end drops the node's local work
        self.newest = 0  # the newest state the swarm serves
        self.caught: list[int] = []  # min_round of each catch-up asked for

    def pull(self) -> None:
        pass

    def catch_up(self, min_round: int, rebase: bool = False) -> bool:
        self.caught.append(min_round)
        if self.newest < min_round:
            return False
        self.progress.clock.finish(self.newest)
        return True

    def end(self, r: int, resync: bool, joining: bool) -> bool:
        self.progress.clock.finish(r)
        self.ended.append((r, resync, joining))
        return joining and self.drops


def _loop(tmp_path: Path, fragments: int, max_rounds: int, *sets: str) -> Any:
    cfg = load_config(None, [f"run.max_rounds={max_rounds}", *sets])
    progress = Progress()
    training = Training(
        device=torch.device("cpu"),
        model=None,  # type: ignore[arg-type]
        plan=[None] * fragments,  # type: ignore[arg-type]
        outer=None,  # type: ignore[arg-type]
        trainer=_Trainer(),  # type: ignore[arg-type]
        feedback=[],
        val_batches=[],
        tokens=(torch.zeros(0), torch.zeros(0)),
        bytes_per_token=1.0,
        workload={},
        site=NoSite(),
    )
    syncer = _Syncer(fragments)
    published: list[tuple[int, int]] = []

    async def publish(record: tuple[int, int]) -> None:
        published.append(record)

    network = SimpleNamespace(
        syncer=syncer,
        deadlines=Deadlines(),
        verifier=SimpleNamespace(round=0, excluded=lambda peers, r: set(), flagged=lambda r: {}),
        live_peers=lambda: {"peer"},
        heard=set,
        control=None,
        record=lambda round_, steps: (round_, steps),
        tracer=None,
        peers=SimpleNamespace(behind=lambda r: [], publish=publish, published=published),
        transport=SimpleNamespace(peer_id="me", run=lambda coro, timeout: asyncio.run(coro)),
    )
    rounds = _Rounds(progress)
    status, events = StatusWriter(tmp_path / "status.json"), EventLog(tmp_path / "events.jsonl")
    running = Running(progress, training, network, status, events, threading.Event())  # type: ignore[arg-type]
    loop = loop_settings(cfg).build(running, rounds)  # type: ignore[arg-type]
    # catching up is the fake's; lingering after the last round is the node's own
    rounds.resync = Resync(round_settings(cfg, tmp_path).resync, running)
    rounds.resync.catch_up = rounds.catch_up  # type: ignore[method-assign]
    return SimpleNamespace(
        loop=loop,
        network=network,
        syncer=syncer,
        rounds=rounds,
        progress=progress,
        cfg=cfg,
        trainer=training.trainer,
    )


class _Scripted:
    """A schedule that hands out syncs by step, and takes results after ``tau`` steps."""

    def __init__(self, script: dict[int, list[tuple[int, int]]], tau: int) -> None:
        self.script = script
        self.tau = tau
        self.step = 0

    def due(self, now: float) -> list[tuple[int, int]]:
        self.step += 1
        return self.script.get(self.step, [])

    def ready(self, pending: Any, steps: int) -> bool:
        return steps - pending.step >= self.tau

    def skips(self, r: int) -> bool:
        return False

    def ended(self, round_: int) -> None:
        pass


def test_steps_rounds_sync_every_fragment_with_the_tokens_trained_for_it(tmp_path) -> None:
    t = _loop(tmp_path, fragments=2, max_rounds=2)
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    # fragment 0 after step 2, fragment 1 after step 4, 8 tokens a step
    assert t.syncer.launched == [(1, 0, 16), (1, 1, 32), (2, 0, 32), (2, 1, 32)]
    assert t.rounds.ended == [(1, False, False), (2, False, False)]
    assert t.progress.bytes_sent == 40 and t.progress.busy > 0


def test_a_finished_loop_says_what_it_trained_that_no_sync_carried(tmp_path) -> None:
    t = _loop(tmp_path, fragments=2, max_rounds=2)
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    (end,) = read_events(tmp_path / "events.jsonl", "unsynced")
    # 8 steps of 8 tokens: round 2 ends as its 4th step launches fragment 1; fragment 0
    # was last launched after step 6, so steps 7 and 8 are in no sync of it
    assert end == {**end, "round": 2, "tokens": 64, "fragments": [16, 0]}
    assert t.trainer.tokens == 64


def test_each_sync_claims_the_assigned_batches_it_was_trained_on(tmp_path) -> None:
    """Round r + 1's stream is trained from the moment round r's first sync starts; each
    fragment's claim covers the draws since its own last sync, stream by stream."""
    t = _loop(tmp_path, fragments=2, max_rounds=2)
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    spans = [c.spans for c in t.syncer.claims]
    # steps 1-2 on round 1's stream; at step 2 fragment 0 syncs and round 2's starts
    assert spans == [
        ((1, 0, 2),),
        ((1, 0, 2), (2, 0, 2)),
        ((2, 0, 4),),
        ((2, 2, 2), (3, 0, 2)),
    ]
    assert all(c.batch == 2 and c.ranks == 1 and c.slice == (0, 1) for c in t.syncer.claims)


def test_a_failed_sync_makes_its_round_take_the_swarms_state(tmp_path) -> None:
    t = _loop(tmp_path, fragments=2, max_rounds=2)
    t.syncer.fail = {(2, 1)}
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    assert t.rounds.ended == [(1, False, False), (2, True, False)]


def test_a_sync_averaged_alone_while_peers_are_live_counts_and_goes_wrong(tmp_path) -> None:
    t = _loop(tmp_path, fragments=1, max_rounds=1)
    t.syncer.group = ["me"]
    t.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert t.progress.alone_syncs == 1
    assert t.rounds.ended == [(1, True, False)]


def test_a_sync_due_while_the_last_one_is_in_flight_is_skipped(tmp_path) -> None:
    t = _loop(tmp_path, fragments=1, max_rounds=1)
    # step 1 starts round 1's sync; step 2 hands out another while it is in flight
    t.loop.run(_Scripted({1: [(1, 0)], 2: [(1, 0)]}, tau=2))
    assert t.syncer.launched == [(1, 0, 8)]
    assert t.syncer.missed == [1]  # its work goes into the next sync
    assert t.rounds.ended == [(1, True, False)]


def test_a_stopped_loop_abandons_its_round(tmp_path) -> None:
    t = _loop(tmp_path, fragments=1, max_rounds=5)
    t.loop.stop.set()
    t.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert t.syncer.launched == [] and t.rounds.ended == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["network.matchmaking_seconds=3", "network.round_timeout=20"], 23.0),
        (
            [
                "network.matchmaking_seconds=3",
                "network.round_timeout=20",
                "sync.trigger='seconds'",
                "sync.round_seconds=10",
            ],
            9.5,  # never past the fragment's next sync
        ),
    ],
)
def test_an_exchange_never_outlasts_its_budget(overrides: list[str], expected: float) -> None:
    cfg = load_config(None, [*overrides, "control.commit=false"])
    assert loop_settings(cfg).exchange_budget(None) == pytest.approx(expected)


def test_the_commit_window_is_part_of_the_budget() -> None:
    cfg = load_config(None, ["network.matchmaking_seconds=3", "network.round_timeout=20"])
    assert cfg.control.commit  # the default
    base = cfg.network.matchmaking_seconds + cfg.network.round_timeout
    assert loop_settings(cfg).exchange_budget(4.0) == pytest.approx(base + 4.0)
    assert loop_settings(cfg).exchange_budget(None) == pytest.approx(
        base + cfg.control.commit_seconds
    )


def test_each_sync_gets_the_budget_its_node_measured(tmp_path) -> None:
    sets = (
        "network.matchmaking_seconds=3",
        "network.round_timeout=60",
        "control.commit=false",
        "sync.trigger='steps'",
    )
    t = _loop(tmp_path, 1, 2, *sets)
    t.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert t.syncer.budgets == [63.0, 63.0]  # nothing measured: the configured budget
    t = _loop(tmp_path, 1, 2, *sets)
    for _ in range(MIN_SAMPLES):
        t.network.deadlines.finished(1.0, 63.0, complete=True)
    t.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert t.syncer.budgets == [3.0 + SLACK_SECONDS] * 2  # the floor: 4 x 1 s is under it


def test_each_round_trains_the_batches_assigned_to_it(tmp_path) -> None:
    """What is trained after round r's sync starts is round r + 1's assignment, drawn
    from its start: anyone can recompute it from the PeerID and the round."""
    t = _loop(tmp_path, fragments=1, max_rounds=2)
    t.loop.run(StepSchedule(inner_steps=3, fragments=1, tau=1, round_=0))
    data = torch.arange(200) % 7

    def firsts(round_: int, count: int) -> list[int]:
        stream = assigned_stream(data, 2, 4, t.cfg.run.run_id, "me", round_)
        return [int(stream.next()[0][0, 0]) for _ in range(count)]

    trained = [first for _, first in t.trainer.trained]
    assert trained[:3] == firsts(1, 3)  # steps 1-3: round 1's, then its sync starts
    assert trained[3:6] == firsts(2, 3)


@pytest.mark.parametrize(
    "status, lingers", [(None, True), ("quarantined", False), ("banned", False)]
)
def test_after_its_last_round_a_node_lingers_for_a_peer_behind_unless_it_flagged_it(
    tmp_path, status: str | None, lingers: bool
) -> None:
    # lingering is bounded by matchmaking_seconds + 3 x round_timeout: 0.8 s here
    t = _loop(tmp_path, 1, 1, "network.matchmaking_seconds=0.2", "network.round_timeout=0.2")
    t.network.peers.behind = lambda r: ["slow"]
    t.network.verifier.flagged = lambda r: {} if status is None else {"slow": status}
    started = time.monotonic()
    t.loop._linger()
    took = time.monotonic() - started
    assert (took >= 0.7) if lingers else (took < 0.3), took


def test_after_its_last_round_a_node_says_so_in_the_registry_before_it_lingers(tmp_path) -> None:
    # A peer lingering for this node reads its record: written only every few seconds,
    # the record of the round before kept that peer waiting until it went stale.
    t = _loop(tmp_path, 1, 1, "network.matchmaking_seconds=0.2", "network.round_timeout=0.2")
    t.progress.clock.finish(4)
    t.loop._linger()
    assert t.network.peers.published == [(4, t.trainer.steps)]


def test_rounds_without_an_exchange_are_counted_and_said_once_a_stretch(tmp_path) -> None:
    t = _loop(tmp_path, 1, 5, "network.alone_rounds=3")
    t.syncer.group = ["me"]  # nobody to exchange with, and nobody live
    t.network.live_peers = set
    t.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert t.progress.exchanges == 0 and t.progress.last_exchange == 0
    said = read_events(tmp_path / "events.jsonl", "alone")
    assert [(e["round"], e["rounds"]) for e in said] == [(3, 3)]  # once, not every round
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["alone_rounds"] == 5 and status["training_alone"] is True

    together = _loop(tmp_path / "b", 2, 3, "network.alone_rounds=1")
    together.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    assert together.progress.exchanges == 6 and together.progress.last_exchange == 3
    assert read_events(tmp_path / "b" / "events.jsonl", "alone") == []


def test_the_first_exchange_is_timed_from_the_launch_once(tmp_path) -> None:
    alone = _loop(tmp_path / "a", 1, 2)
    alone.syncer.group = ["me"]
    alone.network.live_peers = set
    alone.loop.run(StepSchedule(inner_steps=2, fragments=1, tau=1, round_=0))
    assert alone.progress.first_exchange is None
    assert read_events(tmp_path / "a" / "events.jsonl", "first_exchange") == []

    t = _loop(tmp_path / "b", 2, 3)
    t.progress.launched = time.time() - 30.0  # launched half a minute ago
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    (said,) = read_events(tmp_path / "b" / "events.jsonl", "first_exchange")  # once
    assert said["round"] == 1 and 30.0 <= said["seconds"] < 60.0
    assert t.progress.first_exchange == said["seconds"]
    status = json.loads((tmp_path / "b" / "status.json").read_text())
    assert status["first_exchange_s"] == said["seconds"]


class _Joining(_Scripted):
    """Sits round 1 out (a joiner), syncs from round 2."""

    def skips(self, r: int) -> bool:
        return r < 2


def test_a_joiner_whose_work_went_with_the_swarms_state_claims_only_what_it_trains_after(
    tmp_path,
) -> None:
    """Its first contribution carries no more than its own share: the tokens and batches
    of the round it sat out are not claimed, as its work of that round was dropped."""
    t = _loop(tmp_path, fragments=1, max_rounds=2)
    t.rounds.drops = True  # the joiner took the swarm's state at round 1's end
    # round 1's sync is due (skipped) at step 2, round 2's at step 5: 3 steps after
    t.loop.run(_Joining({2: [(1, 0)], 5: [(2, 0)]}, tau=1))
    assert t.rounds.ended[0] == (1, True, True)
    assert t.syncer.launched == [(2, 0, 3 * 8)]
    (claim,) = t.syncer.claims
    assert sum(span[2] for span in claim.spans) == 3  # three draws of one batch each
    # where its state was not taken, its work stays and is claimed in full
    kept = _loop(tmp_path / "kept", fragments=1, max_rounds=2)
    kept.loop.run(_Joining({2: [(1, 0)], 5: [(2, 0)]}, tau=1))
    assert kept.syncer.launched == [(2, 0, 5 * 8)]


def test_a_stopped_node_lets_its_syncs_in_flight_end_and_says_what_they_carried(
    tmp_path,
) -> None:
    """Told to stop with a sync in flight, the loop waits for it (its group takes the
    work in it) instead of cancelling it; a sync that failed stays unsynced work."""
    t = _loop(tmp_path, fragments=2, max_rounds=0)
    left: list[tuple[int, int]] = []

    def leave(pending: Any) -> dict[str, Any] | None:
        left.append((pending.round, pending.fragment))
        return None if pending.fragment == 1 else {"round": pending.round}

    t.syncer.leave = leave

    class _Stopping(_Scripted):
        def due(self, now: float) -> list[tuple[int, int]]:
            out = super().due(now)
            if self.step == 3:
                t.loop.stop.set()  # a signal, once both syncs are in flight
            return out

        def ready(self, pending: Any, steps: int) -> bool:
            return False  # still in flight when the node stops

    t.loop.run(_Stopping({1: [(1, 0)], 2: [(1, 1)]}, tau=1))
    assert left == [(1, 0), (1, 1)]
    (end,) = read_events(tmp_path / "events.jsonl", "unsynced")
    # fragment 0's sync (after step 1) ended in its group: only steps 2 and 3 are
    # unsynced; fragment 1's (after step 2) failed: its 2 steps and step 3
    assert end["fragments"] == [16, 24]


def test_a_node_that_finishes_its_rounds_does_not_wait_on_syncs_in_flight(tmp_path) -> None:
    t = _loop(tmp_path, fragments=2, max_rounds=2)
    t.syncer.leave = lambda pending: pytest.fail("waited on a sync after the last round")
    t.loop.run(StepSchedule(inner_steps=4, fragments=2, tau=1, round_=0))
    assert t.rounds.ended[-1][0] == 2


@pytest.mark.parametrize(
    ("newest", "placed", "joins"),
    [(4, 4, {"from_fragment": 1}), (3, 4, {"contributes_from": 6})],
)
def test_a_node_a_round_behind_takes_the_newer_state_before_sitting_a_round_out(
    tmp_path, newest: int, placed: int, joins: dict
) -> None:
    """A joiner whose caught-up state is of round 3 while round 5 is in progress asks for
    round 4's: where the swarm serves it, the node comes in during round 5 (keeping its
    work); where it does not, after a few tries, it sits round 5 out."""
    t = _loop(tmp_path, 2, 5, "sync.trigger='seconds'", "network.matchmaking_seconds=1")
    t.progress.clock.finish(3)
    t.rounds.newest = newest
    t.loop.stop.wait = lambda seconds: None  # no waiting between tries
    # round 5 of 10-s rounds, 6 s in: fragment 1 (at 10 s) is still ahead
    wall = WallSchedule(SecondsClock(t0=1000.0, round_seconds=10.0, fragments=2), 1, lambda: 1046.0)
    t.loop._newer_state(wall)
    assert t.rounds.caught == [4] * (1 if newest == 4 else 3)
    t.loop._place(wall, SyncBook.of(2))
    assert t.progress.round == placed
    (join,) = read_events(tmp_path / "events.jsonl", "join")
    assert join == {**join, **joins, "round": 5}
    # once the round's last sync is under way, nothing is asked: it is too late
    late = WallSchedule(SecondsClock(1000.0, 10.0, 2), 1, lambda: 1049.5)
    t.progress.clock.finish(3)
    t.rounds.caught = []
    t.loop._newer_state(late)
    assert t.rounds.caught == []
