"""Useful-work checks on two nodes' worth of components (a real model, real signatures, a
real SQLite verifier; the network is a stand-in that serves the contributor's kept
parts): a checker's record reproduces on the other node, and a forged one is refused
and costs its signer."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch

from node.catchup import state_digest
from node.checks import CheckSettings, UsefulWork
from node.config import load_config
from node.data import assigned_stream, load_data, validation_batches
from node.model import build_model
from node.swarm import QUICK_WORKLOAD
from node.trainer import InnerTrainer
from protocol.averaging.contributions import SentParts
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.parts import AllReduceSettings, PartPlan
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import seal_part
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.usefulness import assignment_seed, batch_plan, open_record
from verification.verifier import Verifier

A, B, C, D = (Identity.from_seed(bytes([k]) * 32) for k in (1, 2, 3, 4))
CONTRIBUTORS = sorted(p.peer_id for p in (A, B, C))
ROUND = 3
PRIOR_STEPS = 48
WIRE = AllReduceSettings(run_id="run", codec="int8", block_size=256)


@pytest.fixture(scope="module")
def world() -> SimpleNamespace:
    """The model and data, the global values before the round, and what C trained."""
    torch.manual_seed(0)
    cfg = load_config(None, list(QUICK_WORKLOAD))
    corpus = load_data(cfg.data, cfg.model.context, 256)
    model = build_model(cfg.model, seed=0)
    plan = plan_fragments(model, 1)
    # the rounds before: checks start after the first rounds, once what a contribution
    # learns from its own batches shows beside what any text teaches a new model
    before = InnerTrainer(
        model, cfg.train, assigned_stream(corpus.train, 8, 64, "run", D.peer_id, 0)
    )
    for _ in range(PRIOR_STEPS):
        before.step()
    base = [plan.flatten(dict(model.named_parameters()), 0).detach().clone()]
    stream = assigned_stream(corpus.train, 8, 64, "run", C.peer_id, ROUND)
    trainer = InnerTrainer(model, cfg.train, stream)
    for _ in range(12):
        trainer.step()
    local = plan.flatten(dict(model.named_parameters()), 0).detach()
    val = validation_batches(corpus.val, 8, 64, 4)
    return SimpleNamespace(
        model=model, plan=plan, base=base, pg=base[0] - local, train=corpus.train, val=val
    )


def _sent(pg: torch.Tensor) -> tuple[SentParts, dict[int, bytes]]:
    """C's kept parts of the exchange and the digests it committed to."""
    plan = PartPlan.of(C.peer_id, CONTRIBUTORS, CONTRIBUTORS, pg.numel(), WIRE.block_size)
    parts = {}
    for j, (lo, hi) in enumerate(plan.bounds):
        enc = codecs.encode(pg[lo:hi], "int8", block_size=WIRE.block_size)
        header = Header("part", "run", ROUND, 0, j, C.peer_id)
        meta = {"content": "update", "group": CONTRIBUTORS, "owners": CONTRIBUTORS}
        parts[j] = seal_part(C, header, {**meta, "weight": 12 * 8 * 64, **enc.meta()}, enc.payload)
    sent = SentParts()
    sent.keep((ROUND, 0, "update"), parts)
    return sent, {j: p.digest for j, p in parts.items() if j != plan.index}


class _Net:
    """Serves C's kept parts to whoever asks, as the contributor's RPC would (A and B,
    also contributors, serve nothing here)."""

    def __init__(self, served: SentParts) -> None:
        self.served = served

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run(coro)

    async def call(self, peer: str, name: str, data: bytes, **kwargs: Any) -> bytes:
        if peer != C.peer_id:
            return msgpack.packb([])  # A and B keep nothing here: unserved
        return await self.served.serve("caller", data)


def _node(world, who: Identity, tmp_path: Path, audit: float = 0.0) -> SimpleNamespace:
    sent, digests = _sent(world.pg)
    published: list[bytes] = []
    verifier = Verifier(TrustPolicy(), tmp_path / f"{who.peer_id[-6:]}.db", who.peer_id)
    settings = CheckSettings(
        run_id="run",
        checkers=2,
        batches=2,
        from_round=1,
        min_records=4,
        pass_rate=0.5,
        audit=audit,
        assigned=True,
        batch_size=8,
        context=64,
        timeout=5.0,
    )
    checks = UsefulWork(
        settings,
        who,
        _Net(sent),  # type: ignore[arg-type]
        (WIRE, lambda peer, r, f: dict(digests) if peer == C.peer_id else None, SentParts()),
        verifier,
        world.model,
        world.plan,
        (world.train, world.val),
        lambda data: published.append(data) or True,
        lambda *a, **k: None,
    )
    return SimpleNamespace(checks=checks, published=published, verifier=verifier)


def _done(node: SimpleNamespace, world) -> None:
    after = world.base[0] - world.pg
    digest = state_digest([after])
    node.checks.exchange_done(ROUND, 0, CONTRIBUTORS, [t.clone() for t in world.base], digest)
    node.checks.round_ended(ROUND, went_wrong=False)


def _violations(node: SimpleNamespace, peer: str) -> int:
    return node.verifier.reputation.standing(peer, ROUND).violations


def test_a_record_reproduces_on_another_node(world, tmp_path) -> None:
    a, b = _node(world, A, tmp_path), _node(world, B, tmp_path)
    _done(a, world)
    _done(b, world)
    assert a.published and b.published  # both others check C
    theirs, ours = open_record(a.published[0], "run"), open_record(b.published[0], "run")
    assert theirs.peer == C.peer_id and theirs.checker == A.peer_id
    # two samples of the same contribution: other batches, the same base and contribution.
    # Each checker draws 2 of C's 12 assigned batches and 2 of the 4 validation ones: one
    # of the two draws may coincide, not both here, so the records differ
    assert (theirs.contribution, theirs.global_digest) == (ours.contribution, ours.global_digest)
    seed = bytes.fromhex(theirs.seed)
    plans = [batch_plan(seed, C.peer_id, p.peer_id, 12, 2, len(world.val)) for p in (A, B)]
    assert plans[0] != plans[1], plans
    assert (theirs.assigned, theirs.validation) != (ours.assigned, ours.validation)
    # an honest contribution: it gains more on C's assigned batches than on validation
    for record in (theirs, ours):
        on_assigned, on_val = record.gains
        assert on_assigned is not None and on_assigned > max(on_val, 0), record.gains
    # b checked C too: a's record must match its own, and does
    b.checks.receive(A.peer_id, a.published[0])
    b.checks.judge_inbox()
    assert b.checks.counts["taken"] == 1 and b.checks.counts["refused"] == 0
    # d, in the group but no contributor (it checks no one), recomputes it (audit 1.0)
    d = _node(world, D, tmp_path / "d", audit=1.0)
    _done(d, world)
    assert not d.published
    d.checks.receive(A.peer_id, a.published[0])
    d.checks.judge_inbox()
    assert d.checks.counts["recomputed"] == 1 and d.checks.counts["taken"] == 1
    assert _violations(d, A.peer_id) == 0 and _violations(b, A.peer_id) == 0


def _forge(record_bytes: bytes, **changes: Any) -> bytes:
    record = open_record(record_bytes, "run")
    return dataclasses.replace(record, **changes).signed(A).to_bytes()


@pytest.mark.parametrize(
    "changes",
    [
        {"validation": (5.0, 9.0), "assigned": (5.0, 9.0)},  # losses edited: C looks harmful
        {"seed": "00" * 32},  # another batch seed
        {"global_digest": "11" * 32},  # another base
        {"contribution": "22" * 32},  # another contribution
    ],
    ids=["losses", "seed", "global", "contribution"],
)
def test_a_forged_record_is_refused_and_its_signer_penalised(world, tmp_path, changes) -> None:
    a, b = _node(world, A, tmp_path / "a"), _node(world, B, tmp_path / "b")
    _done(a, world)
    _done(b, world)
    forged = _forge(a.published[0], **changes)
    b.checks.receive(A.peer_id, forged)
    b.checks.judge_inbox()
    assert b.checks.counts["refused"] == 1 and b.checks.counts["taken"] == 0
    assert _violations(b, A.peer_id) == 1 and _violations(b, C.peer_id) == 0
    assert not b.checks.scores.flagged()
    # a node that checked nothing itself recomputes the forged record (audit 1.0) and
    # refuses it too
    d = _node(world, D, tmp_path / "d", audit=1.0)
    _done(d, world)
    d.checks.receive(A.peer_id, forged)
    d.checks.judge_inbox()
    assert d.checks.counts["refused"] == 1 and _violations(d, A.peer_id) == 1


def test_records_of_rounds_before_the_checks_or_not_from_their_signer_count_nothing(
    world, tmp_path
) -> None:
    a, b = _node(world, A, tmp_path / "a"), _node(world, B, tmp_path / "b")
    _done(a, world)
    b.checks.receive(B.peer_id, a.published[0])  # relayed under another sender
    b.checks.receive(A.peer_id, b"\x00garbage")
    b.checks.judge_inbox()
    assert b.checks.counts["taken"] == 0 and b.checks.counts["refused"] == 1
    assert _violations(b, A.peer_id) == 0


def test_the_seed_is_the_groups_agreed_one(world) -> None:
    after = state_digest([world.base[0] - world.pg])
    seed = assignment_seed("run", ROUND, 0, after, CONTRIBUTORS)
    assert seed == assignment_seed("run", ROUND, 0, after, list(reversed(CONTRIBUTORS)))
    assert msgpack.packb(seed)  # bytes on the wire


def test_records_of_a_round_that_went_wrong_here_are_never_published(world, tmp_path) -> None:
    a = _node(world, A, tmp_path)
    digest = state_digest([world.base[0] - world.pg])
    a.checks.exchange_done(ROUND, 0, CONTRIBUTORS, [t.clone() for t in world.base], digest)
    assert not a.published  # held until the round ends
    a.checks.round_ended(ROUND, went_wrong=True)
    assert not a.published and a.checks.counts["made"] == 0


def test_a_record_that_arrives_before_the_nodes_own_exchange_waits_for_it(world, tmp_path) -> None:
    """A slower node gets the others' records of a round before it applied the round's
    exchange: it judges them once it holds the base (here: recomputes and takes)."""
    a, d = _node(world, A, tmp_path / "a"), _node(world, D, tmp_path / "d", audit=1.0)
    _done(a, world)
    d.checks.receive(A.peer_id, a.published[0])
    d.checks.judge_inbox()
    assert d.checks.counts["taken"] == 0 and d.checks.counts["recomputed"] == 0
    _done(d, world)
    assert d.checks.counts["recomputed"] == 1 and d.checks.counts["taken"] == 1


def test_losses_agree_across_thread_counts_within_the_stated_tolerance(world, tmp_path) -> None:
    """Nodes run torch on different numbers of threads: the losses a record names must
    reproduce within ``LOSS_RTOL`` whatever the count."""
    from verification.usefulness import LOSS_RTOL

    a = _node(world, A, tmp_path)
    batches = list(world.val)
    params = a.checks._params([world.base[0] - world.pg])
    threads = torch.get_num_threads()
    try:
        losses = []
        for n in (1, 2):
            torch.set_num_threads(n)
            losses.append(a.checks._loss(params, batches))
    finally:
        torch.set_num_threads(threads)
    assert losses[0] == pytest.approx(losses[1], rel=LOSS_RTOL)
