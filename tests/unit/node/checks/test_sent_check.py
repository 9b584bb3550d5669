"""The sent check on a real model: over syncs of two fragments with int8 and error
feedback, results merged late (``sync.tau``), a sync that failed and one restart, what an
honest node sends is the sum of its trace's windows; zeros, a copy of the swarm's step
and ALIE's shift are not, and the failure reproduces on another node and is refused
when forged."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgpack
import pytest
import torch

from node.checks.claims import WorkLog
from node.checks.replay import Replayer, ReplaySettings
from node.checks.trace import Tracer, TraceSettings
from node.config import load_config
from node.data.corpus import assigned_stream, load_data
from node.ops.swarm import QUICK_WORKLOAD
from node.swarm.byzantine import make_behaviour
from node.train.model import build_model
from node.train.outer import OuterOptimizer
from node.train.trainer import InnerTrainer
from protocol.averaging.fragments import plan_fragments
from protocol.wire import codec as codecs
from protocol.wire.feedback import FeedbackSettings
from verification.binding import passes, sent_apart, slack, trace_sum
from verification.identity import Identity
from verification.replay import open_replay_record
from verification.traces import open_trace

A, B, C = (Identity.from_seed(bytes([k]) * 32) for k in (11, 12, 13))
RUN = "run"
CODEC = {"codec": "int8", "block_size": 256, "stochastic": False, "feedback": True}


class Member:
    """One honest node's inner loop and syncs, as node/run/loop.py and node/run/syncer.py run
    them: claims from a :class:`WorkLog`, a :class:`Tracer` with the fragment plan, an
    int8 error-feedback encode per fragment, results merged ``tau`` steps late."""

    def __init__(self, world: SimpleNamespace, fragments: int = 2) -> None:
        cfg = world.cfg
        self.cfg, self.world = cfg, world
        torch.manual_seed(0)
        self.model = build_model(cfg.model, seed=0)
        self.plan = plan_fragments(self.model, fragments)
        self.outer = OuterOptimizer(self.model, self.plan, cfg.outer)
        self.feedback = [FeedbackSettings("int8", block_size=256).build() for _ in range(fragments)]
        self.work = WorkLog(fragments, batch=cfg.data.batch_size)
        self.tracer = Tracer(TraceSettings(RUN, 3, 1), A, plan=self.plan)
        self.trainer = InnerTrainer(self.model, cfg.train, self._stream(1))
        self.sent: dict[tuple[int, int], torch.Tensor] = {}
        self.traces: dict[tuple[int, int], bytes] = {}
        """Each sync's signed trace, as served when it was launched."""

    def _stream(self, round_: int):
        cfg = self.cfg
        data = self.world.corpus.train
        return assigned_stream(data, cfg.data.batch_size, cfg.model.context, RUN, A.peer_id, round_)

    def assign(self, round_: int) -> None:
        self.trainer.draw_from(self._stream(round_))
        self.work.assign(round_)

    def steps(self, n: int) -> None:
        for _ in range(n):
            at = (self.work.stream, self.work.position)
            self.tracer.before(self.model, self.trainer.optimizer, self.trainer.steps, at)
            self.tracer.after(self.model, self.trainer.step().loss)
            self.work.trained(1)

    def launch(self, r: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        claim = self.tracer.claim(self.work.take(f), r, f)
        self.tracer.keep(self.work.open_spans())
        assert claim.trace is not None
        sent_from = self.outer.local_vector(self.model, f)
        pg = self.outer.pseudo_gradient(self.model, f)
        sent = codecs.decode(self.feedback[f].encode(pg), expected_numel=pg.numel())
        self.sent[(r, f)] = sent
        self.traces[(r, f)] = asyncio.run(self.tracer.serve("c", msgpack.packb(["trace", r, f])))
        return sent, sent_from

    def apply(self, f: int, sent: torch.Tensor, sent_from: torch.Tensor) -> None:
        """The group's mean: this node's own sent values and a neighbour's (a little
        off), stepped by the outer optimizer, then merged with the overlap kept (the
        tracer told first, as node/run/loop.py does)."""
        self.tracer.seal()
        other = sent * 0.8 + 0.001 * torch.randn(
            sent.shape, generator=torch.Generator().manual_seed(f)
        )
        self.outer.step(f, (sent + other) / 2)
        self.outer.merge_local(self.model, f, 0.0, sent_from)
        self.work.settled(f)

    def trace(self, r: int, f: int) -> bytes:
        return self.traces[(r, f)]


@pytest.fixture(scope="module")
def world() -> SimpleNamespace:
    cfg = load_config(None, [*QUICK_WORKLOAD])
    return SimpleNamespace(cfg=cfg, corpus=load_data(cfg.data, cfg.model.context, 256))


def _checker(world: SimpleNamespace, member: Member, **codec) -> Replayer:
    cfg = world.cfg
    settings = ReplaySettings(
        RUN, steps=3, tolerance=0.05, context=cfg.model.context, train=cfg.train, **(codec or CODEC)
    )
    model = build_model(world.cfg.model, seed=1)
    return Replayer(settings, model, world.corpus.train, torch.device("cpu"), None, member.plan)


def _check(checker: Replayer, member: Member, r: int, f: int, sent: torch.Tensor):
    data = member.trace(r, f)
    return checker.sent_check(B.peer_id, open_trace(data, RUN, A.peer_id), data, sent)


def _rounds(member: Member, rounds: range, fail: int | None = None) -> list[tuple[int, int]]:
    """Rounds of 7 steps, fragment 0 launched after 3 and fragment 1 after 6, each result
    merged 2 steps later; fragment 1's sync of round ``fail`` is never applied."""
    synced = []
    for r in rounds:
        member.assign(r)
        member.steps(3)
        sent0, from0 = member.launch(r, 0)
        member.steps(2)
        member.apply(0, sent0, from0)
        member.steps(1)
        sent1, from1 = member.launch(r, 1)
        member.steps(1)
        if r != fail:
            member.apply(1, sent1, from1)
        synced += [(r, 0), (r, 1)]
    return synced


def test_what_an_honest_node_sends_is_the_sum_of_its_trace(world) -> None:
    member = Member(world)
    synced = _rounds(member, range(1, 5), fail=2)
    checker = _checker(world, member)
    distances = []
    for r, f in synced:
        record = _check(checker, member, r, f, member.sent[(r, f)])
        assert record is not None and record.sent
        assert record.passed, (r, f, record.why)
        distances.append(record.distance)
    # int8 with error feedback: a few hundredths apart at most
    assert max(distances) < 0.1, distances
    # the failed sync's batches are claimed again by the next one of its fragment
    failed, after = (open_trace(member.trace(r, 1), RUN) for r in (2, 3))
    assert after.spans[: len(failed.spans) - 1] == failed.spans[:-1]
    assert [s[0] for s in after.spans] == [1, 2, 3]


def test_zeros_a_copy_and_alie_fail_the_sent_check(world) -> None:
    member = Member(world)
    _rounds(member, range(1, 4))
    checker = _checker(world, member)
    r, f = 3, 0
    honest = member.sent[(r, f)]
    attacks = {
        "zero": make_behaviour("zero", 0, None).contribution(r, f, honest),
        "alie": make_behaviour("alie", 0, None).contribution(r, f, honest),
        # the swarm's last step of the fragment: the change of its global copy
        "copy": member.sent[(r - 1, f)],
        "half": honest * 0.5,
    }
    for name, vector in attacks.items():
        record = _check(checker, member, r, f, vector)
        assert record is not None and not record.passed, name
        assert record.distance > 0.3, (name, record.distance)
        assert "apart" in record.why


def test_a_restarted_node_drops_the_work_no_trace_holds(world, tmp_path) -> None:
    """After a restart the tracer is new: the checkpoint's unsynced local work is in no
    window, so node/run/rounds.py resets each local copy to its global one; the first sync
    after it then passes (and would not without the reset)."""
    member = Member(world)
    _rounds(member, range(1, 3))
    member.steps(2)  # work since the last syncs, in the checkpoint
    member.tracer = Tracer(TraceSettings(RUN, 3, 1), A, plan=member.plan)
    member.work = WorkLog(2, batch=world.cfg.data.batch_size)
    kept = [member.outer.pseudo_gradient(member.model, f).norm() for f in range(2)]
    assert min(kept) > 0
    for f in range(2):
        member.outer.sync_local(member.model, f)
    _rounds(member, range(3, 4))
    checker = _checker(world, member)
    assert all(_check(checker, member, 3, f, member.sent[(3, f)]).passed for f in range(2))


def test_the_check_does_not_apply_to_sparse_codecs_nor_to_traces_without_fragment_sketches(
    world,
) -> None:
    member = Member(world)
    _rounds(member, range(1, 2))
    sparse = _checker(world, member, codec="topk", block_size=256, stochastic=False, feedback=True)
    assert _check(sparse, member, 1, 0, member.sent[(1, 0)]) is None
    whole = Tracer(TraceSettings(RUN, 3, 1), A)  # no plan: windows carry no fragment sketch
    assert trace_sum(open_trace(member.trace(1, 0), RUN).windows) is not None
    assert whole.plan is None
    assert slack(torch.ones(10), "topk", 256, False, True) is None


def test_a_failed_sent_check_reproduces_elsewhere_and_a_forged_one_does_not(world) -> None:
    member = Member(world)
    _rounds(member, range(1, 3))
    checker = _checker(world, member)
    zero = torch.zeros_like(member.sent[(2, 1)])
    record = _check(checker, member, 2, 1, zero).signed(B)
    opened = open_replay_record(record.to_bytes(), RUN)
    assert opened.sent and opened.proof and not opened.passed
    other = _checker(world, member)
    again = other.sent_check(C.peer_id, opened.opened, opened.trace, zero)
    assert not again.passed
    # the member really sent its honest values: a record claiming it sent zeros is false
    honest = other.sent_check(C.peer_id, opened.opened, opened.trace, member.sent[(2, 1)])
    assert honest.passed


def test_slack_follows_the_codec_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    assert slack(x, "none", 256, False, True) == 0.0
    fp16, bf16 = (slack(x, c, 256, False, False) for c in ("fp16", "bf16"))
    assert fp16 is not None and bf16 is not None and 0 < fp16 < bf16 < 0.01 * float(x.norm())
    int8, int4 = (slack(x, c, 256, False, True) for c in ("int8", "int4"))
    assert int8 is not None and int4 is not None and 0 < int8 < 0.2 * float(x.norm()) < int4
    assert slack(x, "int8", 256, True, True) == pytest.approx(2 * int8)
    # the bound holds for every honest encode with error feedback
    feedback = FeedbackSettings("int8", block_size=256).build()
    for k in range(5):
        pg = torch.randn(4096, generator=g) * (1 + k)
        sent = codecs.decode(feedback.encode(pg), expected_numel=4096)
        assert float((sent - pg).norm()) <= slack(sent, "int8", 256, False, True)
    moved = torch.ones(64)
    assert sent_apart(moved, -moved) == 0.0
    assert sent_apart(torch.zeros(64), torch.ones(64)) == float("inf")
    assert passes(moved, -moved * 1.04, 0.05, 0.0)
    assert not passes(moved, torch.zeros(64), 0.05, 0.5)
