"""A round's end and the state between rounds, on a real training side (a tiny byte
model), a real checkpoint folder and event log, and stand-ins for the swarm."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.build import build_training
from node.config import load_config
from node.run.metrics import EventLog, StatusWriter
from node.run.rounds import Rounds
from node.run.state import Progress, Running, Training
from node.settings import round_settings
from node.train.agreement import AgreementWatch
from node.train.deadlines import Deadlines

TINY = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.context=16",
    "data.batch_size=2",
    "train.eval_batches=1",
    "run.eval_every=2",
]


class _Server:
    def __init__(self) -> None:
        self.published: list[int] = []
        self.attested: list[tuple[int, str]] = []

    def publish(self, snapshot: Any) -> str:
        self.published.append(snapshot.round)
        return f"digest-{snapshot.round}"

    def attest(self, r: int, digest: str, timeout: float, standing: str = "settled") -> Any:
        self.attested.append((r, digest))
        return None


def _network(live: set[str]) -> Any:
    return SimpleNamespace(
        exchange=SimpleNamespace(settings=SimpleNamespace(mixes=lambda n: False)),
        state_server=_Server(),
        transport=SimpleNamespace(submit=lambda coro: None),
        verifier=SimpleNamespace(flagged=lambda r: [], flush=lambda: True),
        load=SimpleNamespace(sample=lambda: {"cpu": 0.1}),
        syncer=SimpleNamespace(),
        deadlines=Deadlines(),
        checks=None,
        tracer=None,
        live_peers=lambda: live,
        heard=set,
    )


def _rounds(tmp_path: Path, live: set[str] = frozenset()) -> tuple[Rounds, Training]:  # type: ignore[assignment]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a round ends, and the node says what it holds. " * 200)
    cfg = load_config(None, [*TINY, f"data.paths=[{str(corpus)!r}]"])
    training = build_training(cfg, "peer", None, None)
    status = StatusWriter(tmp_path / "status.json", min_interval=0)
    events = EventLog(tmp_path / "events.jsonl")
    network = _network(set(live))
    running = Running(Progress(), training, network, status, events, threading.Event())  # type: ignore[arg-type]
    rounds = round_settings(cfg, tmp_path).build(running, AgreementWatch())
    return rounds, training


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_a_round_ends_published_attested_evaluated_when_due_and_reported(tmp_path) -> None:
    rounds, _ = _rounds(tmp_path)
    rounds.end(1, resync=False, joining=False)
    rounds.end(2, resync=False, joining=False)
    rounds.events.close()
    server = rounds.network.state_server
    assert server.published == [1, 2] and server.attested == [(1, "digest-1"), (2, "digest-2")]
    ends = [e for e in _events(tmp_path) if e["event"] == "round"]
    assert [e["round"] for e in ends] == [1, 2]
    assert "val_bpb" not in ends[0] and ends[1]["val_bpb"] > 0  # run.eval_every = 2
    assert ends[1]["global_digest"] == "digest-2" and ends[1]["load"] == {"cpu": 0.1}
    assert rounds.progress.global_digest == (2, "digest-2")
    assert rounds.status.current["round"] == 2


def test_a_round_that_went_wrong_with_no_peer_keeps_its_own_state(tmp_path) -> None:
    rounds, _ = _rounds(tmp_path, live=set())
    rounds.end(1, resync=True, joining=False)
    assert rounds.progress.global_digest == (1, "digest-1")


def test_a_checkpoint_is_written_once_a_round_and_resumed_from(tmp_path) -> None:
    rounds, training = _rounds(tmp_path)
    training.trainer.step()
    rounds.progress.clock.finish(3)
    rounds.progress.global_digest = (3, "d3")
    rounds.checkpoint()
    rounds.checkpoint()  # the same round: nothing more
    rounds.events.close()
    assert [e["round"] for e in _events(tmp_path) if e["event"] == "checkpoint"] == [3]
    assert rounds.progress.checkpoint_time is not None

    again, fresh = _rounds(tmp_path)
    again.resume()
    assert again.progress.round == 3
    assert (fresh.trainer.steps, fresh.trainer.tokens) == (
        training.trainer.steps,
        training.trainer.tokens,
    )
    for x, y in zip(fresh.model.parameters(), training.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_a_checkpoint_of_another_plan_is_refused(tmp_path) -> None:
    rounds, _ = _rounds(tmp_path)
    rounds.progress.clock.finish(1)
    rounds.checkpoint()
    other, training = _rounds(tmp_path)
    other.training = Training(**{**vars(training), "plan": _OtherPlan()})
    with pytest.raises(ValueError, match="another model or fragment plan"):
        other.resume()


class _OtherPlan:
    def digest(self) -> str:
        return "another"


@pytest.mark.parametrize("joining", [False, True])
def test_a_joiner_takes_the_swarms_state_without_its_own_work_and_says_so(
    tmp_path, joining: bool
) -> None:
    """A node that lost a sync keeps its local work, rebased onto the swarm's state; a
    joiner drops what it trained while it sat the round out (its first contribution
    would carry that round too), and the round's end tells the loop so."""
    rounds, _ = _rounds(tmp_path, live={"p1"})
    rounds.network.transport.run = lambda coro, timeout: None
    rounds.resync._signatures = lambda r, deadline: {"digest-swarm": {"p1": "settled"}}
    calls: list[dict] = []

    def catch_up(**kw: Any) -> bool:
        calls.append(kw)
        return True

    rounds.resync.catch_up = catch_up  # type: ignore[method-assign]
    dropped = rounds.end(1, resync=True, joining=joining)
    assert [c["rebase"] for c in calls] == [not joining]
    assert calls[0]["digest"] == "digest-swarm" and calls[0]["holders"] == ["p1"]
    assert dropped is joining


def test_a_state_taken_from_peers_is_counted_with_its_bytes_and_seconds(
    tmp_path, monkeypatch
) -> None:
    from protocol import catchup

    rounds, training = _rounds(tmp_path, live={"p1", "p2"})
    snap = training.outer.snapshot(3, training.plan.digest(), steps=40)
    rounds.network.transport.run = lambda coro, timeout: None
    rounds.network.record = lambda r, steps: None
    rounds.network.peers = SimpleNamespace(
        identity=None, refresh=lambda record: None, sources=lambda r: ["p1"], live=lambda: {"p1"}
    )
    found: list[Any] = [None, (snap, ["p1", "p2"]), (snap, ["p2"])]
    monkeypatch.setattr(catchup, "download", lambda *a, **k: found.pop(0))
    assert rounds.resync.catch_up(min_round=3) is False  # nobody served: nothing counted
    assert rounds.progress.catch_ups == 0
    assert rounds.resync.catch_up(min_round=3) and rounds.resync.catch_up(min_round=3)
    rounds.events.close()
    size = sum(4 * f.numel for f in training.plan.fragments)  # values; momentum once stepped
    assert snap.nbytes >= size and rounds.progress.catch_ups == 2
    assert rounds.progress.catch_up_bytes == 2 * snap.nbytes
    said = [e for e in _events(tmp_path) if e["event"] == "catch_up"]
    assert [(e["round"], e["sources"], e["bytes"]) for e in said] == [
        (3, ["p1", "p2"], snap.nbytes),
        (3, ["p2"], snap.nbytes),
    ]
    assert all(e["seconds"] >= 0 for e in said)
    status = rounds.status.current
    assert status["catch_ups"] == 2 and status["catch_up_bytes"] == 2 * snap.nbytes
