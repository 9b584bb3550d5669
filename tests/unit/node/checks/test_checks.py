"""Useful-work checks on three members' worth of components: a real model with two
fragments, real signatures, a real SQLite verifier; the network is a stand-in that
serves each member's kept parts. A record reproduces on another node for every
fragment; work that was not done shows; a forged record is refused and costs its
signer; the training thread never waits for a check."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch

from node.checks import (
    CheckHooks,
    CheckParts,
    CheckSettings,
    ExchangeBase,
    Fetcher,
    FetchSettings,
    Measurer,
    UsefulWork,
)
from node.checks.claims import WorkLog
from node.checks.measure import Checked
from node.config import load_config
from node.data.corpus import assigned_stream, load_data
from node.ops.swarm import QUICK_WORKLOAD
from node.train.model import build_model
from node.train.trainer import InnerTrainer
from protocol.averaging.contributions import SentParts
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.parts import AllReduceSettings, PartPlan
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import seal_part
from tests.waiting import wait_until
from verification.gains import judge
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.usefulness import open_record, reproduces
from verification.verifier import Verifier

A, B, C, D = (Identity.from_seed(bytes([k]) * 32) for k in (1, 2, 3, 4))
MEMBERS = sorted(p.peer_id for p in (A, B, C))
ROUND, STEPS, PRIOR = 3, 24, 96
WIRE = AllReduceSettings(run_id="run", codec="int8", block_size=256)
SETTINGS = CheckSettings(
    run_id="run",
    checkers=2,
    windows=16,
    fragments=2,
    from_round=1,
    audit=0.0,
    assigned=True,
    context=64,
    timeout=5.0,
    budget=1.0,
)


@pytest.fixture(scope="module")
def world() -> SimpleNamespace:
    """The model and data, the round's base, and each member's contribution: A and B
    trained honestly on their claims, C trained one step in ten of the steps it claims."""
    torch.manual_seed(0)
    cfg = load_config(None, list(QUICK_WORKLOAD))
    corpus = load_data(cfg.data, cfg.model.context, 256)
    model = build_model(cfg.model, seed=0)
    plan = plan_fragments(model, 2)
    # the rounds before: checks start once what a contribution learns from its own
    # batches shows beside what any text teaches a new model
    before = InnerTrainer(model, cfg.train, assigned_stream(corpus.train, 8, 64, "run", "x", 0))
    for _ in range(PRIOR):
        before.step()
    params = dict(model.named_parameters())
    base = [plan.flatten(params, f).detach().clone() for f in range(2)]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = before.optimizer.state_dict()
    members = {}
    for who, share in ((A, 1.0), (B, 1.0), (C, 0.1)):
        model.load_state_dict(state)
        stream = assigned_stream(corpus.train, 8, 64, "run", who.peer_id, ROUND)
        trainer = InnerTrainer(model, cfg.train, stream)
        trainer.optimizer.load_state_dict(optimizer)
        log = WorkLog(2, batch=8)
        log.assign(ROUND)
        for _ in range(int(STEPS * share)):
            trainer.step()
        log.trained(STEPS)  # claims every step, as the lazy member does
        local = [plan.flatten(dict(model.named_parameters()), f).detach() for f in range(2)]
        members[who.peer_id] = _kept(who, [base[f] - local[f] for f in range(2)], log)
    model.load_state_dict(state)
    update = [sum(m.pgs[f] for m in members.values()) / 3 for f in range(2)]
    return SimpleNamespace(
        model=model, plan=plan, base=base, update=update, members=members, corpus=corpus
    )


def _kept(who: Identity, pgs: list[torch.Tensor], log: WorkLog) -> SimpleNamespace:
    """A member's kept parts of both exchanges, and the digests it committed to."""
    member = SimpleNamespace(sent=SentParts(), committed={})
    for f, pg in enumerate(pgs):
        _keep(member, who, f, "update", pg, "int8", {"work": log.take(f).to_wire()})
    member.pgs = [codecs.decode(codecs.encode(pg, "int8", block_size=256)) for pg in pgs]
    return member


def _keep(
    member: SimpleNamespace, who: Identity, f: int, content: str, value, codec: str, extra
) -> None:
    """Seal ``value`` as ``who``'s parts of exchange ``(ROUND, f, content)``, keep them
    and commit to them."""
    plan = PartPlan.of(who.peer_id, MEMBERS, MEMBERS, value.numel(), WIRE.block_size)
    parts = {}
    for j, (lo, hi) in enumerate(plan.bounds):
        enc = codecs.encode(value[lo:hi], codec, block_size=WIRE.block_size)
        header = Header("part", "run", ROUND, f, j, who.peer_id)
        meta = {"content": content, "group": MEMBERS, "owners": MEMBERS, "weight": 1, **extra}
        parts[j] = seal_part(who, header, {**meta, **enc.meta()}, enc.payload)
    member.sent.keep((ROUND, f, content), parts)
    member.committed[(f, content)] = {j: p.digest for j, p in parts.items() if j != plan.index}


class _Net:
    """Serves every member's kept parts, as each member's RPC would; ``hold`` keeps a
    fetch waiting until it is set."""

    def __init__(self, world: SimpleNamespace) -> None:
        self.world = world
        self.hold: threading.Event | None = None
        self.fetches = 0

    def run(self, coro: Any, timeout: float) -> Any:
        if self.hold is not None:
            self.hold.wait(timeout)
        return asyncio.run(coro)

    async def call(self, peer: str, name: str, data: bytes, **kwargs: Any) -> bytes:
        self.fetches += 1
        return await self.world.members[peer].sent.serve("caller", data)


def _committed(world: SimpleNamespace):
    def digests(peer: str, round_: int, fragment: int, content: str) -> dict[int, bytes] | None:
        member = world.members.get(peer)
        if member is None or round_ != ROUND:
            return None
        return dict(member.committed.get((fragment, content), {})) or None

    return digests


def _node(
    world, who: Identity, tmp_path: Path, audit: float = 0.0, settings: CheckSettings | None = None
) -> SimpleNamespace:
    net = _Net(world)
    own = world.members[who.peer_id].sent if who.peer_id in world.members else SentParts()
    numel = tuple(world.plan[f].numel for f in range(2))
    fetching = FetchSettings(WIRE, numel, 5.0)
    fetcher = Fetcher(who.peer_id, net, fetching, _committed(world), own)  # type: ignore[arg-type]
    if settings is None:
        settings = (
            SETTINGS if audit == 0 else CheckSettings(**{**SETTINGS.__dict__, "audit": audit})
        )
    corpus = world.corpus
    measurer = Measurer(settings, world.model, world.plan, corpus.train, corpus.val, "cpu")
    policy = TrustPolicy(checkers=2, check_min_records=2)
    verifier = Verifier(policy, tmp_path / f"{who.peer_id[-6:]}.db", who.peer_id)
    published: list[bytes] = []
    events: list[tuple[str, dict]] = []
    training = [1000.0]  # seconds of inner steps so far (the budget's measure)
    checks = UsefulWork(
        settings,
        2,
        CheckParts(who, verifier, measurer, fetcher),
        CheckHooks(
            lambda data: published.append(data) or True,
            lambda name, **fields: events.append((name, fields)),
            lambda: training[0],
        ),
    )
    return SimpleNamespace(
        training=training,
        checks=checks,
        net=net,
        measurer=measurer,
        fetcher=fetcher,
        published=published,
        events=events,
        verifier=verifier,
    )


def _exchanges(world) -> list[ExchangeBase]:
    return [
        ExchangeBase(ROUND, f, world.base[f].clone(), world.update[f], tuple(MEMBERS), 0.7)
        for f in range(2)
    ]


def _end_round(node: SimpleNamespace, world, went_wrong: bool = False) -> None:
    for exchange in _exchanges(world):
        node.checks.exchange_applied(exchange)
    node.checks.round_ended(ROUND, went_wrong)


def _inputs(world):
    from node.checks import RoundBook

    book = RoundBook(2)
    for exchange in _exchanges(world):
        book.applied(exchange)
    return book.close(ROUND).prepare()


def _record(node, world, peer: Identity, checker: Identity, fragment: int):
    fetch = node.fetcher.get
    inputs = _inputs(world)
    return node.measurer.record(
        inputs,
        fragment,
        peer.peer_id,
        checker.peer_id,
        Checked(fetch(peer.peer_id, ROUND, fragment)),
        Checked(fetch(checker.peer_id, ROUND, fragment)),
    )


def test_a_record_reproduces_on_another_node_for_every_fragment(world, tmp_path) -> None:
    a, b = _node(world, A, tmp_path), _node(world, B, tmp_path)
    for fragment in (0, 1):
        mine = _record(a, world, C, A, fragment).signed(A)
        opened = open_record(mine.to_bytes(), "run")
        theirs = _record(b, world, C, A, fragment)  # B recomputes A's record of C
        assert reproduces(opened, theirs), fragment
        assert opened.claimed == STEPS and len(opened.assigned) == SETTINGS.windows
        assert len(opened.control) == 2 * SETTINGS.windows
    # another fragment, another seed and other windows: the records differ
    assert _record(a, world, C, A, 0).seed != _record(a, world, C, A, 1).seed


def test_work_that_was_not_done_shows_in_the_record(world, tmp_path) -> None:
    """B's honest work measured by A is about as much as A's own; C trained a tenth of
    the steps it claims and gains a fraction of it."""
    a = _node(world, A, tmp_path)
    for fragment in (0, 1):
        honest = judge(_record(a, world, B, A, fragment))
        lazy = judge(_record(a, world, C, A, fragment))
        assert honest.ref_gain is not None and honest.ref_gain.mean > 0, honest
        assert honest.gain.mean > 0.5 * honest.ref_gain.mean, honest
        assert lazy.gain.mean < 0.5 * honest.gain.mean, (lazy, honest)


def test_the_training_thread_is_never_held_by_a_check(world, tmp_path) -> None:
    """With a fetch held open, handing over the round's exchanges and its end returns at
    once, and inner steps go on; the check finishes once the fetch is let go."""
    a = _node(world, A, tmp_path)
    a.net.hold = threading.Event()
    a.checks.start()
    try:
        started = time.monotonic()
        _end_round(a, world)
        handed = time.monotonic() - started
        assert not wait_until(lambda: a.net.fetches > 0 or a.checks.counts["made"] > 0, 1)
        model = build_model(load_config(None, list(QUICK_WORKLOAD)).model, seed=1)
        stream = assigned_stream(world.corpus.train, 8, 64, "run", "y", 9)
        trainer = InnerTrainer(model, load_config(None, list(QUICK_WORKLOAD)).train, stream)
        for _ in range(5):
            trainer.step()  # training goes on while the check waits for its fetch
        assert handed < 0.5 and trainer.steps == 5 and a.checks.counts["made"] == 0
        a.net.hold.set()
        # a record is counted as made just before it is published: wait for both
        made = lambda: a.checks.counts["made"]  # noqa: E731
        assert wait_until(lambda: made() >= 2 and len(a.published) == made(), 60), (
            a.checks.summary(),
            len(a.published),
        )
    finally:
        a.net.hold.set()
        a.checks.close()


def test_a_forged_record_is_refused_and_its_signer_penalised(world, tmp_path) -> None:
    """B signs a record of A's contribution whose losses are not what it measured; A,
    whom it accuses, recomputes it and charges B."""
    b = _node(world, B, tmp_path)
    honest = _record(b, world, A, B, 0)
    control = tuple((b, a + 0.5, rb, ra) for b, a, rb, ra in honest.control)
    forged = type(honest)(**{**honest.__dict__, "control": control}).signed(B)
    a = _node(world, A, tmp_path)
    a.checks.start()
    try:
        _end_round(a, world)
        a.checks.receive(B.peer_id, forged.to_bytes())
        assert wait_until(lambda: a.checks.counts["refused"] >= 1, 60), a.checks.summary()
        standing = a.verifier.reputation.standing(B.peer_id, ROUND)
        assert standing.violations >= 1
        assert any(name == "check_refused" for name, _ in a.events)
        # a record not signed by the peer that sent it, or of a round before the checks,
        # is not counted at all
        a.checks.receive(C.peer_id, honest.signed(B).to_bytes())
        early = type(honest)(**{**honest.__dict__, "round": 0}).signed(B)
        a.checks.receive(B.peer_id, early.to_bytes())
        assert wait_until(lambda: not a.checks._inbox, 10)
        assert a.checks.counts["taken"] == 0
    finally:
        a.checks.close()


def test_nothing_of_a_round_that_went_wrong_is_checked(world, tmp_path) -> None:
    a = _node(world, A, tmp_path)
    a.checks.start()
    try:
        _end_round(a, world, went_wrong=True)
        assert not wait_until(lambda: a.net.fetches > 0, 2)
        assert a.checks.counts["made"] == 0 and a.published == []
    finally:
        a.checks.close()


def test_a_record_that_arrives_before_its_round_ends_here_waits_for_it(world, tmp_path) -> None:
    b = _node(world, B, tmp_path)
    record = _record(b, world, C, B, 1).signed(B)
    a = _node(world, A, tmp_path)
    a.checks.start()
    try:
        a.checks.receive(B.peer_id, record.to_bytes())
        assert not wait_until(lambda: a.checks.counts["taken"] > 0, 1)
        _end_round(a, world)
        assert wait_until(lambda: a.checks.counts["taken"] == 1, 60), a.checks.summary()
        assert a.checks.scores.score(C.peer_id)["records"] >= 1
    finally:
        a.checks.close()


def test_losses_agree_across_thread_counts_within_the_stated_tolerance(world, tmp_path) -> None:
    a = _node(world, A, tmp_path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _record(a, world, C, A, 0)
        torch.set_num_threads(2)
        two = _record(_node(world, B, tmp_path), world, C, A, 0)
    finally:
        torch.set_num_threads(threads)
    assert reproduces(one, two)


def test_where_the_group_mixed_a_contribution_is_measured_from_its_members_copy(
    world, tmp_path
) -> None:
    """In a group that mixed copies, *before* a contribution is the copy its member
    sent (fetched against its commitment), and *after* is that copy less the
    pseudo-gradient: a member whose copy sat ``delta`` from the base and whose
    pseudo-gradient is ``delta`` lands exactly on the base."""
    a = _node(world, A, tmp_path)
    inputs = _inputs(world)
    mixed = copy.copy(inputs)
    mixed.exchanges = [
        dataclasses.replace(e, mixed=True) if e.fragment == 1 else e for e in inputs.exchanges
    ]
    drift = SimpleNamespace(sent=SentParts(), committed={})
    delta = 0.02 * torch.randn(world.base[1].shape, generator=torch.Generator().manual_seed(5))
    _keep(drift, C, 1, "weights", world.base[1] + delta, "none", {})
    _keep(drift, C, 1, "update", delta, "none", {})
    kept, world.members[C.peer_id] = world.members[C.peer_id], drift
    try:
        fetch = a.fetcher.get
        checked = Checked(fetch(C.peer_id, ROUND, 1), fetch(C.peer_id, ROUND, 1, "weights"))
        reference = Checked(fetch(A.peer_id, ROUND, 1))
        record = a.measurer.record(mixed, 1, C.peer_id, A.peer_id, checked, reference)
        plain = a.measurer.record(inputs, 1, A.peer_id, A.peer_id, reference, reference)
    finally:
        world.members[C.peer_id] = kept
    before, after = zip(*((row[0], row[1]) for row in record.control), strict=True)
    at_base = [row[0] for row in plain.control]
    assert list(after) == pytest.approx(at_base, rel=1e-6)
    assert max(abs(b - x) for b, x in zip(before, at_base, strict=True)) > 1e-3
    # the copy is part of what the record names
    assert record.contribution != Checked(checked.update).digest
    # a copy that was not served is not measured
    with pytest.raises(ProtocolError):
        a.fetcher.get(B.peer_id, ROUND, 1, "weights")


def test_a_served_contribution_request_is_what_the_fetcher_sends(world) -> None:
    served = asyncio.run(world.members[C.peer_id].sent.serve("x", msgpack.packb([ROUND, 1])))
    assert len(msgpack.unpackb(served)) == len(MEMBERS)


def test_each_check_waits_for_the_budget_of_training_time(world, tmp_path) -> None:
    """With ``check_budget`` 5 %, a check waits while the forwards so far exceed 5 % of
    the time spent in inner steps, and goes on once training has caught up: one check at
    a time, not a round's checks at once."""
    budget = CheckSettings(**{**SETTINGS.__dict__, "budget": 0.05})
    a = _node(world, A, tmp_path, settings=budget)
    a.training[0] = 0.0
    a.measurer.seconds = 1.0  # forwards of earlier rounds
    a.checks.start()
    try:
        _end_round(a, world)
        assert not wait_until(lambda: a.checks.counts["made"] > 0, 2)
        a.training[0] = 20.0  # 1 s of checks is 5 % of 20 s of training
        assert wait_until(lambda: a.checks.counts["made"] >= 1, 60), a.checks.summary()
        # that check's forwards took the share past 5 %: the round's next check waits
        assert not wait_until(lambda: a.checks.counts["made"] >= 2, 2), a.checks.summary()
        a.training[0] = 1e6
        assert wait_until(lambda: a.checks.counts["made"] >= 2, 60), a.checks.summary()
    finally:
        a.checks.close()


def test_sent_checks_run_at_once_and_replays_and_records_wait_for_the_budget(
    world, tmp_path
) -> None:
    """A drawn check's sent check is cheap and runs as soon as the round is drawn; its
    replay waits for the budget, and the record after it is made only where the replay
    left budget for it."""
    a = _node(world, A, tmp_path, settings=CheckSettings(**{**SETTINGS.__dict__, "budget": 0.05}))
    a.training[0] = 0.0
    a.measurer.seconds = 1.0  # forwards of earlier rounds
    replays = a.checks.replays
    replays.replayer = SimpleNamespace(seconds=0.0, steps=0)
    calls: list[tuple] = []
    pending = SimpleNamespace()

    def check(inputs, fragment: int, peer: str):
        calls.append(("sent", fragment, peer))
        return pending

    def replay(p) -> None:
        assert p is pending
        calls.append(("replay",))
        replays.replayer.seconds += 1.0  # what a replay costs

    replays.check, replays.replay = check, replay
    a.checks.start()
    try:
        _end_round(a, world)
        assert wait_until(lambda: calls, 10)
        drawn = len(calls)
        assert not wait_until(lambda: ("replay",) in calls, 2), calls
        assert drawn >= 1 and all(c[0] == "sent" for c in calls)
        # 1 s of checks is 5 % of 20 s of training: one replay, which spends the rest
        a.training[0] = 20.0
        assert wait_until(lambda: a.checks.counts["unmeasured"] == 1, 30), a.checks.summary()
        assert calls.count(("replay",)) == 1 and a.checks.counts["made"] == 0
        a.training[0] = 1e6
        assert wait_until(lambda: a.checks.counts["made"] == drawn - 1, 60), a.checks.summary()
        assert calls.count(("replay",)) == drawn
    finally:
        a.checks.close()


def test_checks_more_than_two_rounds_behind_are_dropped(world, tmp_path) -> None:
    """A worker that fell behind keeps the checks of the two newest rounds it has: the
    drawn but unmade checks of an older round go, counted once as a skipped round."""
    a = _node(world, A, tmp_path)  # its worker is not started: nothing is taken
    work = a.checks
    with work._wake:
        work._todo.extend((SimpleNamespace(round=4), f, "p") for f in (0, 1))
        work._todo.append((SimpleNamespace(round=5), 0, "p"))
        work._rounds.append(SimpleNamespace(round=6))
        work._drop_behind()
        assert [t[0].round for t in work._todo] == [5]
        assert [i.round for i in work._rounds] == [6]
    assert work.counts["skipped"] == 1


@pytest.mark.parametrize("records_charge", [True, False])
def test_records_charge_a_flagged_peer_only_where_no_replay_and_sent_checks_run(
    world, tmp_path, records_charge: bool
) -> None:
    """Check records that flag a peer charge it with ``useless_work`` where replay and
    sent checks do not both run; where they do, the records only weigh its contributions
    (its weight factor falls), and a failed replay still charges it."""
    settings = dataclasses.replace(SETTINGS, records_charge=records_charge)
    a = _node(
        world, A, tmp_path, settings=settings
    )  # its worker is not started: count is called here
    lazy = C.peer_id
    for r in range(1, 5):
        for honest in ("h1", "h2", "h3"):
            a.checks.records.count(_synthetic(honest, "c0", r, gain=0.2))
        a.checks.records.count(_synthetic(lazy, ("c1", "c2")[r % 2], r, gain=0.02))
    score = a.checks.scores.score(lazy)
    assert score["flagged"] and score["factor"] < 0.2, score
    assert [f["flagged"] for n, f in a.events if n == "check" and f["peer"] == lazy][-1]
    charged = a.verifier.reputation.standing(lazy, 4).violations
    assert (charged > 0) is records_charge  # once a round, from its second round of records
    # a failed replay is evidence: it charges under either setting
    a.checks.scores.replay_failed(lazy, B.peer_id, 5, proven=True)
    a.checks.records.count(_synthetic(lazy, "c1", 5, gain=0.02))
    assert a.verifier.reputation.standing(lazy, 5).violations == charged + 1


def _synthetic(peer: str, checker: str, round_: int, gain: float):
    """A check record of ``peer`` whose windows all gain ``gain`` (the checker's own
    contribution 0.2) and lift as much as the checker's."""
    from verification.usefulness import CheckRecord

    before = 3.0
    return CheckRecord(
        checker=checker,
        peer=peer,
        run="run",
        round=round_,
        fragment=0,
        contribution="a",
        reference="b",
        base="c",
        result="d",
        seed="e",
        claimed=16,
        reference_claimed=16,
        assigned=tuple((before, before - gain - 0.3) for _ in range(4)),
        reference_assigned=tuple((before, before - 0.5) for _ in range(4)),
        control=tuple((before, before - gain, before, before - 0.2) for _ in range(4)),
    )


def test_a_round_whose_fragments_were_exchanged_in_other_groups_is_not_checked(world) -> None:
    """A peer that dropped out of view between two fragments' syncs regrouped the rest of
    the round: its members hold other exchanges of the earlier fragments, so no member
    checks it (each draws seeds from all of the round's exchanges)."""
    from node.checks import RoundBook

    book = RoundBook(2)
    for exchange in _exchanges(world):
        book.applied(dataclasses.replace(exchange, group=tuple(MEMBERS)))
    assert book.close(ROUND) is not None and book.regrouped == 0
    for exchange in _exchanges(world):
        group = tuple(MEMBERS) if exchange.fragment == 0 else tuple(MEMBERS[:-1])
        book.applied(dataclasses.replace(exchange, group=group))
    assert book.close(ROUND) is None and book.regrouped == 1
