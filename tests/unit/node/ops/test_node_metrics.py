"""Every metric family moves when the event it counts happens.

The node's own snapshot (:meth:`node.ops.reporter.Reporter.monitor_state`, and the training
loop's inner step) runs on the real components: an inner trainer, a syncer, the
all-reduce's byte and refusal counters, a verifier with its SQLite store, a status file. Each test scrapes, makes one event happen through the
component that records it, and scrapes again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.config import AtollConfig, ModelConfig, TrainConfig
from node.data.corpus import BatchStream
from node.ops.monitor import metrics_of
from node.ops.reporter import Reporter
from node.run.metrics import StatusWriter
from node.run.state import Progress, Running, Training
from node.settings import loop_settings
from node.train.model import build_model
from node.train.schedule import SyncBook
from node.train.site_leader import NoSite
from node.train.trainer import InnerTrainer
from protocol.averaging.context import AllReduceContext
from protocol.averaging.hooks import Hooks
from protocol.averaging.parts import AllReduceSettings
from protocol.errors import ProtocolError
from tests.unit.node.run.test_syncer import FakeExchange, _syncer
from verification.policy import TrustPolicy
from verification.verifier import Verifier

PEER = "12D3KooWPeerOfTheMetricsTestxxxxxxxxxxxxxxxxxxxx"
Samples = dict[tuple[str, tuple], float]


class _Judge:
    def on_refusal(self, *args: Any) -> None:
        pass


class _StandIn(SimpleNamespace):
    """The components a test reaches, and the node's snapshot and inner step."""

    def monitor_state(self) -> dict[str, Any]:
        return self.reporter.monitor_state()

    def _step(self, tokens_since: list[int]) -> None:
        self.loop._step(SyncBook(tokens_since=tokens_since))


@pytest.fixture
def node(tmp_path: Path):
    cfg = AtollConfig()
    data = torch.tensor(list(b"metrics move when things happen " * 40), dtype=torch.uint8)
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, context=8), seed=0)
    trainer = InnerTrainer(
        model, TrainConfig(lr=1e-2, warmup_steps=1, total_steps=10), BatchStream(data, 2, 8, "k")
    )
    syncer, _, _ = _syncer(tmp_path, FakeExchange(averaged=torch.zeros(4)))
    allreduce = AllReduceContext(None, None, AllReduceSettings(run_id="r"), Hooks(judge=_Judge()))  # type: ignore[arg-type]
    verifier = Verifier(TrustPolicy(), tmp_path / "atoll.db", "12D3KooWme")
    status = StatusWriter(tmp_path / "status.json", min_interval=0)
    progress = Progress(global_digest=(1, "ab" * 32))
    progress.clock.finish(1)
    training = Training(
        device=torch.device("cpu"),
        model=model,
        plan=[None],  # type: ignore[arg-type]  # one fragment; the step reads no plan
        outer=None,  # type: ignore[arg-type]
        trainer=trainer,
        feedback=[],
        val_batches=[],
        tokens=(torch.zeros(0), torch.zeros(0)),
        bytes_per_token=1.0,
        workload={},
        site=NoSite(),
    )
    reporter = Reporter("r", "s", progress, status, tmp_path)
    reporter.training = training
    reporter.network = SimpleNamespace(  # type: ignore[assignment]
        allreduce=SimpleNamespace(context=allreduce),
        syncer=syncer,
        transport=SimpleNamespace(reachability=None),
    )
    network = SimpleNamespace(tracer=None)
    running = Running(progress, training, network, status, None, threading.Event())  # type: ignore[arg-type]
    loop = loop_settings(cfg).build(running, None)  # type: ignore[arg-type]
    stand_in = _StandIn(
        status=status,
        progress=progress,
        reporter=reporter,
        loop=loop,
        allreduce=allreduce,
        syncer=syncer,
        verifier=verifier,
    )
    try:
        yield stand_in
    finally:
        allreduce.worker.shutdown()
        verifier.close()


def _scrape(node: _StandIn) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics_of(node.monitor_state())
        for s in family.samples
    }


def _moved(before: Samples, after: Samples, name: str, labels: tuple = ()) -> bool:
    return after.get((name, labels), 0.0) > before.get((name, labels), 0.0)


def test_an_inner_step_moves_steps_tokens_throughput_and_loss(node) -> None:
    before = _scrape(node)
    node._step([0])
    after = _scrape(node)
    for name in ("atoll_inner_steps_total", "atoll_tokens_total", "atoll_tokens_per_second"):
        assert _moved(before, after, name), name
    assert ("atoll_train_loss", ()) not in before and after[("atoll_train_loss", ())] > 0


def test_a_new_round_moves_the_round_and_its_evaluation_sets_bits_per_byte(node) -> None:
    before = _scrape(node)
    node.progress.clock.finish(2)
    node.status.update(round=2, val_bpb=3.5)  # as the node does when a round ends
    after = _scrape(node)
    assert _moved(before, after, "atoll_round")
    assert after[("atoll_val_bits_per_byte", ())] == 3.5


def test_traffic_moves_the_byte_counters(node) -> None:
    before = _scrape(node)
    node.allreduce.tally((1, 0, "update"), sent=1000, received=2000)
    after = _scrape(node)
    assert after[("atoll_sent_bytes_total", ())] - before[("atoll_sent_bytes_total", ())] == 1000
    received = ("atoll_received_bytes_total", ())
    assert after[received] - before[received] == 2000


def test_each_sync_outcome_moves_its_own_counter(node) -> None:
    syncer = node.syncer
    before = _scrape(node)
    syncer.apply(syncer.launch(1, 0, 100, 0, {"peer"}, set(), 5.0), 0)
    after = _scrape(node)
    assert _moved(before, after, "atoll_syncs_total", (("outcome", "complete"),))
    assert not _moved(before, after, "atoll_syncs_total", (("outcome", "failed"),))
    syncer.exchange.fail = ProtocolError("no_owner", "nobody to dial")
    syncer.apply(syncer.launch(2, 0, 100, 0, {"peer"}, set(), 5.0), 0)
    assert _moved(after, _scrape(node), "atoll_syncs_total", (("outcome", "failed"),))


def test_a_refused_message_moves_its_reason(node) -> None:
    before = _scrape(node)
    node.allreduce.reject("bad_signature", "forged", PEER, 1, 0)
    after = _scrape(node)
    assert _moved(before, after, "atoll_refused_messages_total", (("reason", "bad_signature"),))


def test_a_violation_moves_reputation_and_a_ban_moves_standing(node) -> None:
    def report() -> Samples:
        node.verifier.flush()
        node.status.update(reputations=node.verifier.reputations())  # as the node reports
        return _scrape(node)

    node.verifier.operator("pardon", PEER, "")  # the peer becomes known, in good standing
    before = report()
    node.verifier.on_refusal(PEER, 1, 0, "bad_signature")
    violated = report()
    node.verifier.operator("ban", PEER, "test")
    banned = report()
    score = ("atoll_peer_reputation", (("peer", PEER),))
    assert violated[score] < before[score]
    assert before[("atoll_peer_standing", (("peer", PEER), ("standing", "ok")))] == 1
    assert banned[("atoll_peer_standing", (("peer", PEER), ("standing", "banned")))] == 1
    assert ("atoll_peer_standing", (("peer", PEER), ("standing", "ok"))) not in banned


def test_peers_sidecar_restarts_and_dropped_control_messages(node) -> None:
    node.status.update(live_peers=1, swarm={"peers": {}, "sidecar_restarts": 0, "dropped": {}})
    before = _scrape(node)
    swarm = {"peers": {PEER: {}}, "sidecar_restarts": 1, "dropped": {"malformed": 2}}
    node.status.update(live_peers=2, swarm=swarm)  # a peer joins, the sidecar restarts
    after = _scrape(node)
    assert _moved(before, after, "atoll_peers", (("source", "dht"),))
    assert _moved(before, after, "atoll_peers", (("source", "control"),))
    assert _moved(before, after, "atoll_sidecar_restarts_total")
    assert _moved(before, after, "atoll_control_dropped_total", (("reason", "malformed"),))


def test_a_checkpoint_resets_its_age(node) -> None:
    node.progress.checkpoint_time = time.time() - 100
    before = _scrape(node)[("atoll_checkpoint_age_seconds", ())]
    node.progress.checkpoint_time = time.time()  # as Rounds.checkpoint records a save
    after = _scrape(node)[("atoll_checkpoint_age_seconds", ())]
    assert before >= 100 > after >= 0
