"""Replay checks on a real model: a node's trace of its training replays on another
node window by window, across thread counts and gradient accumulation, with windows cut
where a sync changed the model; a member that trained a tenth or half of the steps it
claims fails on the windows it skipped; what is served is checked against what was
committed."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch

from node.checks import CheckHooks, CheckParts, CheckSettings, UsefulWork
from node.checks.claims import WorkLog
from node.checks.replay import Replayer, ReplaySettings, Unavailable
from node.checks.replays import Pending
from node.checks.trace import Tracer, TraceSettings
from node.config import load_config
from node.data.corpus import assigned_stream, load_data
from node.ops.swarm import QUICK_WORKLOAD
from node.swarm.byzantine import trainer_class
from node.train.model import build_model
from node.train.trainer import InnerTrainer, make_inner_optimizer
from node.train.trainstate import Snapshot, StateError, load_state, pack_state, state_digest
from protocol.errors import ProtocolError
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.replay import ReplayRecord, drawn_window, open_replay_record
from verification.traces import open_trace
from verification.verifier import Verifier

A, B, C, D = (Identity.from_seed(bytes([k]) * 32) for k in (5, 6, 7, 8))
RUN, ROUND = "run", 4
SEED = b"\x07" * 32


def _world(accum: int = 1, overrides: tuple[str, ...] = ()) -> SimpleNamespace:
    cfg = load_config(None, [*QUICK_WORKLOAD, f"train.grad_accum={accum}", *overrides])
    corpus = load_data(cfg.data, cfg.model.context, 256)
    return SimpleNamespace(cfg=cfg, corpus=corpus)


def _train(
    world: SimpleNamespace,
    steps: int,
    window: int,
    share: float = 1.0,
    poke_at: int | None = None,
    announce: bool = True,
    spill: Path | None = None,
) -> SimpleNamespace:
    """A member that trains ``steps`` steps of its round-``ROUND`` assignment (a
    ``share`` of them really, the rest counted only: ``--byzantine lazy``'s trainer),
    traced in windows of ``window``; ``poke_at``: a sync changes the model before that
    step (announced to the tracer as the loop does, or not); ``spill``: every start
    state goes to a file of that folder."""
    cfg = world.cfg
    torch.manual_seed(0)
    model = build_model(cfg.model, seed=0)
    batch, context = cfg.data.batch_size, cfg.model.context
    stream = assigned_stream(world.corpus.train, batch, context, RUN, A.peer_id, ROUND)
    mode = None if share == 1.0 else f"lazy={share}"
    trainer = trainer_class(mode)(model, cfg.train, stream)
    for _ in range(3):  # the rounds before: the optimizer holds moments
        trainer.step()
    trainer.draw_from(assigned_stream(world.corpus.train, batch, context, RUN, A.peer_id, ROUND))
    work = WorkLog(1, batch=batch)
    work.assign(ROUND)
    tracer = Tracer(TraceSettings(RUN, window, cfg.train.grad_accum, spill=spill, memory=0), A)
    for i in range(steps):
        if i == poke_at:
            if announce:
                tracer.seal()
            with torch.no_grad():
                next(model.parameters()).add_(0.01)  # an outer step, applied mid-round
        tracer.before(model, trainer.optimizer, trainer.steps, (work.stream, work.position))
        tracer.after(model, trainer.step().loss)
        work.trained(cfg.train.grad_accum)
    claim = tracer.claim(work.take(0), ROUND, 0)
    return SimpleNamespace(model=model, trainer=trainer, tracer=tracer, claim=claim)


def _serve(member: SimpleNamespace):
    def fetch(peer: str, request: list) -> bytes:
        return asyncio.run(member.tracer.serve("checker", msgpack.packb(request)))

    return fetch


def _replayer(world: SimpleNamespace, member: SimpleNamespace, fetch=None) -> Replayer:
    cfg = world.cfg
    settings = ReplaySettings(
        RUN, steps=4, tolerance=0.05, context=cfg.model.context, train=cfg.train
    )
    model = build_model(world.cfg.model, seed=1)
    return Replayer(
        settings,
        model,
        world.corpus.train,
        torch.device("cpu"),
        fetch or _serve(member),
    )


def _every_window(world, member) -> list:
    replayer = _replayer(world, member)
    trace = open_trace(
        asyncio.run(member.tracer.serve("c", msgpack.packb(["trace", ROUND, 0]))), RUN
    )
    out = []
    for index, w in enumerate(trace.windows):
        state = asyncio.run(member.tracer.serve("c", msgpack.packb(["state", w.state])))
        out.append(replayer.judge(B.peer_id, trace, b"", index, state))
    return out


def test_an_honest_trace_replays_window_by_window_across_thread_counts() -> None:
    world = _world()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        member = _train(world, steps=10, window=4, poke_at=6)
    finally:
        torch.set_num_threads(threads)
    trace = open_trace(
        asyncio.run(member.tracer.serve("c", msgpack.packb(["trace", ROUND, 0]))), RUN, A.peer_id
    )
    assert trace.digest == member.claim.trace
    # 4 steps, then a window cut short at the sync that changed the model, then 4
    assert [w.steps for w in trace.windows] == [4, 2, 4]
    torch.set_num_threads(2)
    try:
        records = _every_window(world, member)
    finally:
        torch.set_num_threads(threads)
    assert all(r.passed for r in records), [r.why for r in records]
    assert max(r.distance for r in records) < 1e-3
    assert max(r.loss for r in records) < 1e-4


def test_a_model_changed_unannounced_drops_its_window_rather_than_record_it() -> None:
    """A change the loop did not announce (:meth:`Tracer.seal`) would put a change no
    inner step made into the window: the window is dropped, and the claim's batches are
    no longer tiled, which a checker sees on its face."""
    world = _world()
    member = _train(world, steps=10, window=4, poke_at=6, announce=False)
    trace = open_trace(
        asyncio.run(member.tracer.serve("c", msgpack.packb(["trace", ROUND, 0]))), RUN
    )
    assert [w.steps for w in trace.windows] == [4, 4]  # steps 4 and 5 are in none
    replayer = _replayer(world, member)
    assert replayer.inconsistent(trace) == "its windows do not tile the batches it claims"


def test_gradient_accumulation_replays() -> None:
    world = _world(accum=2)
    member = _train(world, steps=4, window=2)
    records = _every_window(world, member)
    assert [r.passed for r in records] == [True, True]


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_skipped_steps_fail_their_windows(share: float) -> None:
    world = _world()
    member = _train(world, steps=20, window=2, share=share)
    records = _every_window(world, member)
    failed = [r for r in records if not r.passed]
    # every window holds a step the member skipped, but where half is done a window
    # of two holds one trained step and one skipped: each fails
    assert len(failed) == len(records) == 10
    assert all("apart" in r.why for r in failed)


def test_a_check_draws_a_window_and_compares_what_was_served_with_the_claim() -> None:
    world = _world()
    member = _train(world, steps=6, window=2)
    replayer = _replayer(world, member)
    record = replayer.check(B.peer_id, A.peer_id, (ROUND, 0), member.claim, SEED)
    assert record is not None and record.passed and record.trace
    assert replayer.steps == 2 and replayer.bytes_fetched > 0
    signed = record.signed(B)
    opened = open_replay_record(signed.to_bytes(), RUN)
    assert opened.proof and opened.passed and opened.peer == A.peer_id

    untraced = dataclasses.replace(member.claim, trace=None)
    assert replayer.check(B.peer_id, A.peer_id, (ROUND, 0), untraced, SEED).why == (
        "its claim carries no trace"
    )
    other = dataclasses.replace(member.claim, trace="0" * 64)
    assert (
        "not the one its claim names"
        in replayer.check(B.peer_id, A.peer_id, (ROUND, 0), other, SEED).why
    )
    more = dataclasses.replace(member.claim, spans=((ROUND, 0, 7),))
    wrong = replayer.check(B.peer_id, A.peer_id, (ROUND, 0), more, SEED)
    assert not wrong.passed

    def nothing(peer: str, request: list) -> bytes:
        return b""

    def down(peer: str, request: list) -> bytes:
        raise Unavailable("timeout")

    # a member that serves nothing (a restart lost its trace) is not judged on it, as
    # one that cannot be reached
    assert (
        _replayer(world, member, nothing).check(
            B.peer_id, A.peer_id, (ROUND, 0), member.claim, SEED
        )
        is None
    )
    assert (
        _replayer(world, member, down).check(B.peer_id, A.peer_id, (ROUND, 0), member.claim, SEED)
        is None
    )

    def wrong_state(peer: str, request: list) -> bytes:
        if request[0] == "state":
            return b"\x00" * 10
        return _serve(member)(peer, request)

    record = _replayer(world, member, wrong_state).check(
        B.peer_id, A.peer_id, (ROUND, 0), member.claim, SEED
    )
    assert not record.passed and not record.state
    assert not open_replay_record(record.signed(B).to_bytes(), RUN).proof


def test_a_window_longer_than_the_run_allows_is_refused_on_its_face() -> None:
    world = _world()
    member = _train(world, steps=6, window=6)
    record = _replayer(world, member).check(B.peer_id, A.peer_id, (ROUND, 0), member.claim, SEED)
    assert not record.passed and "longer than trust.replay_steps" in record.why


def test_a_packed_state_loads_only_into_its_model_and_optimizer() -> None:
    world = _world()
    cfg = world.cfg
    model = build_model(cfg.model, seed=0)
    optimizer = make_inner_optimizer(model, cfg.train)
    stream = assigned_stream(world.corpus.train, 8, cfg.model.context, RUN, A.peer_id, 1)
    trainer = InnerTrainer(model, cfg.train, stream)
    trainer.optimizer = optimizer
    trainer.step()
    packed = pack_state(list(model.parameters()), optimizer)
    other = build_model(cfg.model, seed=3)
    other_opt = make_inner_optimizer(other, cfg.train)
    load_state(packed, list(other.parameters()), other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert pack_state(list(other.parameters()), other_opt) == packed
    with pytest.raises(StateError):
        load_state(b"junk", list(other.parameters()), other_opt)
    with pytest.raises(StateError, match="not this model"):
        load_state(packed, list(other.parameters())[:-1], other_opt)
    # bytes cut short, or one byte more, or a header that runs past the end
    with pytest.raises(StateError, match="run past its end|do not match"):
        load_state(packed[:-4], list(other.parameters()), other_opt)
    with pytest.raises(StateError, match="do not match"):
        load_state(packed + b"\x00", list(other.parameters()), other_opt)
    with pytest.raises(StateError, match="header runs past"):
        load_state(struct.pack("<Q", 1 << 40) + packed[8:], list(other.parameters()), other_opt)
    # a state whose first parameter is NaN: refused before anything is written
    (length,) = struct.unpack("<Q", packed[:8])
    first = list(model.parameters())[0]
    nan = torch.full_like(first, float("nan")).reshape(-1).view(torch.uint8).numpy().tobytes()
    poisoned = packed[: 8 + length] + nan + packed[8 + length + len(nan) :]
    with pytest.raises(StateError, match="non-finite"):
        load_state(poisoned, list(other.parameters()), other_opt)
    assert pack_state(list(other.parameters()), other_opt) == packed
    # the digest a trace names is the packed bytes'
    assert Snapshot(list(model.parameters()), optimizer).digest == state_digest(packed)


def test_the_tracer_serves_what_it_keeps_and_refuses_malformed_requests() -> None:
    world = _world()
    member = _train(world, steps=4, window=2)
    serve = member.tracer.serve
    assert asyncio.run(serve("c", msgpack.packb(["trace", ROUND + 1, 0]))) == b""
    assert asyncio.run(serve("c", msgpack.packb(["state", "f" * 64]))) == b""
    for bad in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb(["other", 1])):
        with pytest.raises(ProtocolError):
            asyncio.run(serve("c", bad))
    kept = member.tracer.kept_bytes()
    assert kept > 0
    member.tracer.keep([])  # the claim's trace still names its windows' states
    assert member.tracer.kept_bytes() == kept


def _checks(world, members: dict, tmp_path, me: Identity = B) -> SimpleNamespace:
    """A node's checks (no worker thread: records are judged by calling in), whose
    replayer asks ``members`` (PeerID to a trained member) for traces and states."""

    def fetch(peer: str, request: list) -> bytes:
        return _serve(members[peer])(peer, request)

    replayer = _replayer(world, None, fetch)
    settings = CheckSettings(
        run_id=RUN,
        checkers=2,
        windows=4,
        fragments=1,
        from_round=1,
        audit=0.0,
        assigned=True,
        context=world.cfg.model.context,
        timeout=5.0,
        budget=1.0,
    )
    verifier = Verifier(TrustPolicy(checkers=2), tmp_path / f"{me.peer_id[-6:]}.db", me.peer_id)
    events: list[tuple[str, dict]] = []
    fetcher = SimpleNamespace(replay=fetch, bytes_fetched=0)
    measurer = SimpleNamespace(seconds=0.0, forwards=0)
    checks = UsefulWork(
        settings,
        1,
        CheckParts(me, verifier, measurer, fetcher, replayer),  # type: ignore[arg-type]
        CheckHooks(
            lambda data: True, lambda name, **fields: events.append((name, fields)), lambda: 1.0
        ),
    )
    return SimpleNamespace(checks=checks, verifier=verifier, events=events)


def _failure(member: SimpleNamespace, checker: Identity, index: int = 0, why: str = "x") -> bytes:
    data = asyncio.run(member.tracer.serve("c", msgpack.packb(["trace", ROUND, 0])))
    record = ReplayRecord(checker.peer_id, A.peer_id, ROUND, 0, data, index, False, 1.0, 0.0, why)
    return record.signed(checker).to_bytes()


def _violations(node: SimpleNamespace, who: Identity) -> int:
    return node.verifier.standings.reputation.standing(who.peer_id, ROUND).violations


def test_a_gossiped_failure_is_replayed_here_and_convicts_only_when_it_reproduces(tmp_path) -> None:
    world = _world()
    lazy = _train(world, steps=8, window=2, share=0.1)
    honest = _train(world, steps=8, window=2)
    # a lazy member's failed window, gossiped by C: this node replays it and fails too
    node = _checks(world, {A.peer_id: lazy}, tmp_path / "a")
    node.checks._judge(C.peer_id, _failure(lazy, C))
    assert node.checks.scores.proven(A.peer_id) and A.peer_id in node.checks.scores.flagged()
    assert node.checks.counts["replays_confirmed"] == 1
    assert _violations(node, A) == 1
    # an honest member's window reported failed by a lying C: it replays here, so the
    # record is false and C pays for it; A is not flagged
    node = _checks(world, {A.peer_id: honest}, tmp_path / "b")
    node.checks._judge(C.peer_id, _failure(honest, C))
    assert not node.checks.scores.proven(A.peer_id)
    assert A.peer_id not in node.checks.scores.flagged()
    assert _violations(node, C) == 1
    assert _violations(node, A) == 0
    refused = [f for name, f in node.events if name == "check_refused"]
    assert refused and "does not reproduce" in refused[0]["why"]
    # sent by another than its checker: dropped
    node.checks._judge(D.peer_id, _failure(honest, C))
    assert _violations(node, C) == 1


def test_a_failure_without_evidence_counts_as_its_checkers_word(tmp_path) -> None:
    world = _world()
    honest = _train(world, steps=4, window=2)
    node = _checks(world, {A.peer_id: honest}, tmp_path)
    for checker in (C, D):
        word = ReplayRecord(checker.peer_id, A.peer_id, ROUND, 0, b"", 0, False, why="no trace")
        node.checks._judge(checker.peer_id, word.signed(checker).to_bytes())
    # two checkers' word flags it (one lying checker cannot)
    assert A.peer_id in node.checks.scores.flagged()
    assert not node.checks.scores.proven(A.peer_id)


def test_start_states_beyond_the_memory_kept_go_to_files_and_are_removed(tmp_path) -> None:
    world = _world()
    cfg = world.cfg
    model = build_model(cfg.model, seed=0)
    stream = assigned_stream(world.corpus.train, 8, cfg.model.context, RUN, A.peer_id, 1)
    trainer = InnerTrainer(model, cfg.train, stream)
    spill = tmp_path / "trace"
    tracer = Tracer(TraceSettings(RUN, 2, 1, spill=spill, memory=0), A)
    work = WorkLog(1, batch=8)
    work.assign(1)
    for _ in range(4):
        tracer.before(model, trainer.optimizer, trainer.steps, (work.stream, work.position))
        tracer.after(model, trainer.step().loss)
        work.trained(1)
    claim = tracer.claim(work.take(0), 1, 0)
    tracer.flush()  # the states are written on the trace's thread
    files = sorted(spill.glob("*.state"))
    assert len(files) == 2 and not list(spill.glob("*.part"))
    summary = tracer.summary()
    assert summary["snapshots"] == 2 and 0 < summary["seconds"] == round(tracer.spent(), 3)
    assert summary["kept_bytes"] == sum(f.stat().st_size for f in files)
    trace = open_trace(asyncio.run(tracer.serve("c", msgpack.packb(["trace", 1, 0]))), RUN)
    assert trace.digest == claim.trace
    state = asyncio.run(tracer.serve("c", msgpack.packb(["state", trace.windows[1].state])))
    assert state == files[[f.stem for f in files].index(trace.windows[1].state)].read_bytes()
    # the claim's trace is dropped three rounds on: its states with it
    tracer.claim(dataclasses.replace(claim, spans=((9, 0, 1),)), 1 + 3, 0)
    tracer.keep([])
    assert not list(spill.glob("*.state"))
    tracer.close()
    # files a node that did not stop cleanly left are removed by the next one
    (spill / "old.state").write_bytes(b"x")
    (spill / "old.part").write_bytes(b"x")
    Tracer(TraceSettings(RUN, 2, 1, spill=spill, memory=0), A).close()
    assert not list(spill.iterdir())


def test_once_the_seed_is_known_only_the_drawn_windows_state_is_kept(tmp_path) -> None:
    """A claim's trace keeps every window's start state until the round's seed draws the
    one its first checker replays; then only that one is kept and served (the trace
    still is), in memory or in a file; a trace no one replays keeps none."""
    world = _world()
    for spill in (None, tmp_path / "trace"):
        tracer = _train(world, steps=8, window=2, spill=spill).tracer
        tracer.keep([])  # everything trained is claimed, as the loop tells it
        tracer.flush()

        def served(request: list, tracer: Tracer = tracer) -> bytes:
            return asyncio.run(tracer.serve("c", msgpack.packb(request)))

        states = [w.state for w in open_trace(served(["trace", ROUND, 0]), RUN).windows]
        assert len(states) == 4 and all(served(["state", d]) for d in states)
        index = drawn_window(SEED, C.peer_id, len(states))
        tracer.drawn(ROUND, 0, SEED, C.peer_id)
        tracer.drawn(ROUND, 0, SEED, D.peer_id)  # told once: the first word holds
        tracer.drawn(ROUND, 1, SEED, C.peer_id)  # no such trace: nothing happens
        tracer.flush()
        assert [bool(served(["state", d])) for d in states] == [i == index for i in range(4)]
        assert served(["trace", ROUND, 0])
        if spill is not None:
            assert [f.stem for f in spill.glob("*.state")] == [states[index]]
        tracer.close()
    member = _train(world, steps=4, window=2)
    member.tracer.keep([])
    member.tracer.drawn(ROUND, 0, SEED, None)
    assert member.tracer.kept_bytes() == 0


def test_a_replay_not_served_is_counted_against_no_one_with_its_reason(tmp_path) -> None:
    """A member that answers it keeps no start state (a restart, or a draw other than
    the checker's) and one that does not answer are told apart, in the counts and in an
    ``unserved`` event; neither is charged. A failure gossiped about this node itself is
    not replayed against itself."""
    world = _world()
    member = _train(world, steps=8, window=2)
    member.tracer.keep([])
    trace = open_trace(_serve(member)("c", ["trace", ROUND, 0]), RUN)
    data = trace.to_bytes()
    index = drawn_window(SEED, B.peer_id, len(trace.windows))
    other = next(
        s
        for s in (bytes([i]) * 32 for i in range(64))
        if drawn_window(s, B.peer_id, len(trace.windows)) != index
    )
    member.tracer.drawn(ROUND, 0, other, B.peer_id)  # keeps another window's state
    node = _checks(world, {A.peer_id: member}, tmp_path / "a")
    node.checks.replays.replay(Pending(trace, data, SEED))
    assert node.checks.counts["replay_unserved"] == 1
    assert node.checks.counts["replay_unanswered"] == 0
    [(name, fields)] = [(n, f) for n, f in node.events if n == "unserved"]
    assert fields["peer"] == A.peer_id and "no longer keeps" in fields["why"]

    def down(peer: str, request: list) -> bytes:
        raise Unavailable("TimeoutError: no answer in 5 s")

    node.checks.replays.replayer.fetch = down
    node.checks.replays.replay(Pending(trace, data, SEED))
    assert node.checks.counts["replay_unanswered"] == 1
    assert "no answer" in node.events[-1][1]["why"]
    assert _violations(node, A) == 0 and not node.checks.scores.flagged()
    # a failure of B's own work, gossiped to B: not fetched from itself, not counted
    node = _checks(world, {}, tmp_path / "b")
    record = ReplayRecord(C.peer_id, B.peer_id, ROUND, 0, b"", 0, False, why="x")
    node.checks._judge(C.peer_id, record.signed(C).to_bytes())
    assert node.checks.counts["taken"] == 0 and node.events == []


@pytest.mark.parametrize("optimizer", ["soap", "muon", "sgd"])
def test_every_inner_optimizer_replays(optimizer: str) -> None:
    world = _world(overrides=(f"train.optimizer='{optimizer}'",))
    member = _train(world, steps=4, window=2)
    records = _every_window(world, member)
    assert [r.passed for r in records] == [True, True], [r.why for r in records]
    lazy = _train(world, steps=4, window=2, share=0.5)
    assert not any(r.passed for r in _every_window(world, lazy))
