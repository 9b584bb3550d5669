"""A fragment sync without a network: what is sent, what is applied, failures, mixing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from node.config import AtollConfig
from node.run.metrics import EventLog, read_events
from node.run.syncer import Copies, Syncer, SyncWatchers, staleness_weight
from node.settings import sync_settings
from node.train.deadlines import MIN_SAMPLES, Deadlines
from node.train.outer import OuterOptimizer
from protocol.averaging.exchange import ExchangeOutcome
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.parts import AllReduceResult
from protocol.errors import ProtocolError
from protocol.wire.feedback import FeedbackSettings


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))


class FakeExchange:
    """Answers every exchange with a fixed average (and a mean copy when mixing)."""

    def __init__(self, averaged: torch.Tensor, mixed: torch.Tensor | None = None) -> None:
        self.averaged, self.mixed = averaged, mixed
        self.calls: list[tuple] = []
        self.fail: Exception | None = None
        self.refused: dict[str, str] = {}

    async def run(
        self,
        r,
        f,
        weight,
        contribution,
        weights,
        expected,
        excludes,
        deadline,
        base="",
        claim=None,
    ) -> ExchangeOutcome:
        self.announced = (base, claim)
        self.calls.append(
            (r, f, weight, contribution.clone(), weights.clone(), expected, excludes, deadline)
        )
        if self.fail is not None:
            raise self.fail
        group = ["me", "peer"]
        result = AllReduceResult(self.averaged, group, [group], [], owners=group)
        mixed = None
        if self.mixed is not None:
            mixed = AllReduceResult(self.mixed, group, [group], [], owners=group)
        return ExchangeOutcome(group, result, mixed, dict(self.refused))


def _submit(coro) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(asyncio.run(coro))
    except Exception as exc:
        future.set_exception(exc)
    return future


def _syncer(
    tmp_path: Path, exchange: FakeExchange, deadlines: Deadlines | None = None, **sync
) -> tuple[Syncer, Toy, OuterOptimizer]:
    cfg = AtollConfig().replace(
        sync={"codec": "none", "mix_codec": "none", **sync},
        outer={"optimizer": "sgd", "lr": 1.0, "momentum": 0.0},
    )
    model = Toy()
    plan = plan_fragments(model, 1)
    outer = OuterOptimizer(model, plan, cfg.outer)
    feedback = [FeedbackSettings("none", block_size=cfg.sync.block_size).build()]
    events = EventLog(tmp_path / "events.jsonl")
    copies = Copies(model, outer, feedback, torch.device("cpu"))
    watchers = SyncWatchers(deadlines=deadlines)
    syncer = sync_settings(cfg).build(copies, exchange, _submit, events, watchers)
    return syncer, model, outer


def _train(model: Toy, delta: list[float]) -> None:
    with torch.no_grad():
        model.w.add_(torch.tensor(delta))


def test_launch_sends_the_pseudo_gradient_and_apply_steps_and_merges(tmp_path: Path) -> None:
    exchange = FakeExchange(averaged=torch.tensor([0.5, 0.5, 0.5, 0.5]))
    syncer, model, outer = _syncer(tmp_path, exchange)
    _train(model, [-1.0, 0.0, 1.0, 0.0])
    pending = syncer.launch(1, 0, tokens=300, step=7, expected={"peer"}, excludes=set(), budget=5.0)
    r, f, weight, contribution, _, expected, _, deadline = exchange.calls[0]
    assert (r, f, weight, expected) == (1, 0, 300, {"peer"})
    assert deadline == pending.deadline and 4.0 < deadline - time.monotonic() <= 5.0
    torch.testing.assert_close(contribution, torch.tensor([1.0, 0.0, -1.0, 0.0]))  # global - local
    record = syncer.apply(pending, step=9)
    # plain averaging (sgd, lr 1): global := global - averaged, and local := global
    expected_global = torch.tensor([0.5, 1.5, 2.5, 3.5])
    torch.testing.assert_close(outer.global_vector(0), expected_global)
    torch.testing.assert_close(model.w.detach(), expected_global)
    assert (
        record["overlap_steps"] == 2 and record["complete"] and record["owners"] == ["me", "peer"]
    )
    assert [e["round"] for e in read_events(tmp_path / "events.jsonl", "sync")] == [1]


def test_a_failed_sync_applies_nothing_and_discounts_the_next_one(tmp_path: Path) -> None:
    exchange = FakeExchange(averaged=torch.zeros(4))
    exchange.fail = ProtocolError("no_owner", "nobody to dial")
    syncer, model, outer = _syncer(tmp_path, exchange)
    _train(model, [1.0, 1.0, 1.0, 1.0])
    before = outer.global_vector(0)
    assert syncer.apply(syncer.launch(1, 0, 100, 0, set(), set(), 5.0), 0) is None
    torch.testing.assert_close(outer.global_vector(0), before)
    torch.testing.assert_close(model.w.detach(), before + 1.0)  # the work stays local
    assert syncer.missed == [1]
    assert read_events(tmp_path / "events.jsonl", "sync_failed")[0]["fragment"] == 0
    exchange.fail = None
    syncer.launch(2, 0, 100, 0, set(), set(), 5.0)
    assert exchange.calls[-1][2] == staleness_weight(100, 1) == 50


def test_a_sync_left_as_the_node_stops_is_waited_for_and_applies_nothing(
    tmp_path: Path,
) -> None:
    exchange = FakeExchange(averaged=torch.tensor([0.5, 0.5, 0.5, 0.5]))
    syncer, model, outer = _syncer(tmp_path, exchange)
    _train(model, [-1.0, 0.0, 1.0, 0.0])
    before, local = outer.global_vector(0), model.w.detach().clone()
    record = syncer.leave(syncer.launch(3, 0, 300, 7, {"peer"}, set(), 5.0))
    assert record is not None and record["contributors"] == [["me", "peer"]]
    torch.testing.assert_close(outer.global_vector(0), before)
    torch.testing.assert_close(model.w.detach(), local)
    (left,) = read_events(tmp_path / "events.jsonl", "sync_left")
    assert (left["round"], left["fragment"], left["tokens"], left["step"]) == (3, 0, 300, 7)
    assert not read_events(tmp_path / "events.jsonl", "sync")
    exchange.fail = ProtocolError("no_owner", "nobody to dial")
    assert syncer.leave(syncer.launch(4, 0, 100, 9, set(), set(), 5.0)) is None
    assert read_events(tmp_path / "events.jsonl", "sync_failed")[0]["tokens"] == 100


def test_mixing_groups_adopt_the_mean_copy_then_step(tmp_path: Path) -> None:
    mean_copy = torch.tensor([10.0, 10.0, 10.0, 10.0])
    exchange = FakeExchange(averaged=torch.tensor([1.0, 1.0, 1.0, 1.0]), mixed=mean_copy)
    syncer, model, outer = _syncer(tmp_path, exchange)
    syncer.apply(syncer.launch(1, 0, 10, 0, set(), set(), 5.0), 0)
    torch.testing.assert_close(outer.global_vector(0), mean_copy - 1.0)
    _, _, _, _, weights, _, _, _ = exchange.calls[0]
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # own copy as sent


def test_gossip_pulls_towards_the_partner_through_the_gradient(tmp_path: Path) -> None:
    mean_copy = torch.tensor([3.0, 4.0, 5.0, 6.0])  # own copy is 2 below the pair's mean
    exchange = FakeExchange(averaged=torch.zeros(4), mixed=mean_copy)
    syncer, _, outer = _syncer(tmp_path, exchange, averaging="gossip", gossip_gamma=0.5)
    syncer.apply(syncer.launch(1, 0, 10, 0, set(), set(), 5.0), 0)
    # gradient = averaged + gamma / lr * (own - mean) = 0.5 * -2; sgd lr 1: w - (-1) = w + 1
    torch.testing.assert_close(outer.global_vector(0), torch.tensor([2.0, 3.0, 4.0, 5.0]))


@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_streaming_merge_keeps_alpha_of_the_local_copy(tmp_path: Path, alpha: float) -> None:
    exchange = FakeExchange(averaged=torch.zeros(4))
    syncer, model, outer = _syncer(tmp_path, exchange, alpha=alpha)
    _train(model, [4.0, 4.0, 4.0, 4.0])
    syncer.apply(syncer.launch(1, 0, 10, 0, set(), set(), 5.0), 0)
    g = outer.global_vector(0)
    torch.testing.assert_close(model.w.detach(), alpha * (g + 4.0) + (1 - alpha) * g)


def test_peers_refused_by_an_exchange_are_remembered(tmp_path: Path) -> None:
    exchange = FakeExchange(averaged=torch.zeros(4))
    exchange.refused = {"stranger": "spec_mismatch: ..."}
    syncer, _, _ = _syncer(tmp_path, exchange)
    syncer.apply(syncer.launch(1, 0, 10, 0, set(), set(), 5.0), 0)
    assert syncer.refused == {"stranger": "spec_mismatch: ..."}


def test_steps_taken_while_the_exchange_runs_are_kept_for_the_next_sync(tmp_path: Path) -> None:
    exchange = FakeExchange(averaged=torch.tensor([0.5, 0.5, 0.5, 0.5]))
    syncer, model, outer = _syncer(tmp_path, exchange)
    _train(model, [-1.0, 0.0, 1.0, 0.0])
    pending = syncer.launch(1, 0, 100, 0, set(), set(), 5.0)
    _train(model, [0.25, 0.25, 0.25, 0.25])  # inner steps while the exchange runs
    syncer.apply(pending, step=3)
    new_global = torch.tensor([0.5, 1.5, 2.5, 3.5])
    torch.testing.assert_close(outer.global_vector(0), new_global)
    torch.testing.assert_close(model.w.detach(), new_global + 0.25)  # the overlap survives
    # ... and is what the next sync contributes
    syncer.launch(2, 0, 100, 0, set(), set(), 5.0)
    torch.testing.assert_close(exchange.calls[-1][3], torch.full((4,), -0.25))


def test_each_exchange_tells_the_deadlines_how_long_it_took(tmp_path: Path) -> None:
    exchange = FakeExchange(averaged=torch.zeros(4))
    deadlines = Deadlines()
    syncer, model, _ = _syncer(tmp_path, exchange, deadlines)
    for r in range(1, MIN_SAMPLES + 1):
        pending = syncer.launch(r, 0, tokens=10, step=r, expected=set(), excludes=set(), budget=5.0)
        time.sleep(0.05)  # applied later than the exchange ended: that wait does not count
        assert syncer.apply(pending, step=r) is not None
    # every exchange ended at once (in _submit): measured well under the 50 ms waits
    measured = deadlines.summary()["measured_p90"]
    assert measured is not None and 0.0 <= measured < 0.04
    # a failed exchange that used up its budget doubles the next one
    before = deadlines.budget(60.0, 1.0)
    exchange.fail = ProtocolError("timeout", "a peer never answered")
    pending = syncer.launch(9, 0, tokens=10, step=9, expected=set(), excludes=set(), budget=0.0)
    assert syncer.apply(pending, step=9) is None
    assert deadlines.budget(60.0, 1.0) == pytest.approx(min(60.0, 2 * before))
