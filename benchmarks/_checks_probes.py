"""Two probes of what the useful-work checks' traces cost, on one process: whether a
replayed window of inner steps is exact and what a replayed step costs
(:func:`replay_probe`), and what keeping a trace costs the training thread
(:func:`tracer_probe`). :mod:`benchmarks._robustness_checks` stores both beside the
swarms' cost runs (:mod:`benchmarks._checks_cost`).
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import time
from typing import Any

from benchmarks._checks_cost import COST_CASES
from node.config import load_config

__all__ = ["replay_probe", "tracer_probe"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def replay_probe(steps: int = 40, window: int = 5) -> dict[str, Any]:
    """What the replay direction would cost and whether it is exact, on the demo model.

    A member that kept a signed trace of its inner steps (the batches, and a hash and a
    low-dimensional sketch of its state every few steps) could be checked by replaying a
    window of it from its start state. Here: train ``steps`` steps, keep the state (the
    parameters and the inner optimizer's moments), replay ``window`` steps from it twice
    on one thread and once on two, and compare the end states bitwise and by a seeded
    64-value sketch; time a replayed step against a check's forward of the same batch.
    """
    import copy

    import torch

    from node.data.corpus import BatchStream, load_data
    from node.train.model import build_model, vocab_of
    from node.train.trainer import InnerTrainer, window_losses

    cfg = load_config([str(_ROOT / "configs/local-swarm.toml")], [])
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        model = build_model(cfg.model, seed=0)
        stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, "probe")
        trainer = InnerTrainer(model, cfg.train, stream)
        for _ in range(steps):
            trainer.step()
        start = (copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()))
        replay = functools.partial(_replay, trainer, start, corpus.train, steps, window)
        one, step_seconds = replay(1)
        again, _ = replay(1)
        two, _ = replay(2)
        torch.set_num_threads(1)
        x, y = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, "f").next()
        began = time.perf_counter()
        window_losses(model, x, y, dict(model.named_parameters()))
        forward = time.perf_counter() - began
    finally:
        torch.set_num_threads(threads)
    params = one.numel()
    state_bytes = params * 4 + _moment_bytes(trainer.optimizer)
    return {
        "model_params": params,
        "trained_steps": steps,
        "window": window,
        **_replay_agreement(one, again, two),
        "replayed_step_seconds": step_seconds,
        "forward_seconds_same_batch": forward,
        "start_state_bytes": state_bytes,
        "start_state_bytes_per_param": state_bytes / params,
    }


def _replay(
    trainer: Any, start: tuple[dict, dict], train: Any, steps: int, window: int, n_threads: int
) -> tuple[Any, float]:
    """``window`` inner steps of ``trainer`` from the state ``start`` (parameters, optimizer)
    that ``steps`` steps reached, on ``n_threads`` threads: the parameters after them,
    flat, and the seconds per step."""
    import copy

    import torch

    from node.data.corpus import BatchStream

    torch.set_num_threads(n_threads)
    model = trainer.model
    model.load_state_dict(start[0])
    trainer.optimizer.load_state_dict(copy.deepcopy(start[1]))  # loading aliases it
    trainer.steps = steps  # the same place in the learning-rate schedule
    torch.manual_seed(steps)  # dropout's draws: a trace would name their seed
    trainer.stream = BatchStream(train, trainer.stream.batch_size, trainer.stream.context, "w")
    began = time.perf_counter()
    for _ in range(window):
        trainer.step()
    took = (time.perf_counter() - began) / window
    return torch.cat([p.detach().flatten() for p in model.parameters()]), took


def _moment_bytes(optimizer: Any) -> int:
    """Bytes of an optimizer's per-parameter state (its moments; scalars left out)."""
    import torch

    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.numel() > 1
    )


def _replay_agreement(one: Any, again: Any, two: Any) -> dict[str, Any]:
    """Whether replays on one thread agree bitwise, whether one and two threads do, and how
    far apart the latter are, coordinate-wise and by a seeded 64-value sketch."""
    import torch

    projection = torch.randn(64, one.numel(), generator=torch.Generator().manual_seed(7))
    sketch_one, sketch_two = projection @ one, projection @ two
    return {
        "bitwise_on_one_thread": bool(torch.equal(one, again)),
        "bitwise_one_vs_two_threads": bool(torch.equal(one, two)),
        "max_relative_difference_one_vs_two_threads": float(
            ((one - two).abs().max() / one.abs().max()).item()
        ),
        "sketch_relative_difference_one_vs_two_threads": float(
            ((sketch_one - sketch_two).norm() / sketch_one.norm()).item()
        ),
    }


def tracer_probe(window: int = 4, steps: int = 24, repeats: int = 2) -> dict[str, Any]:
    """What the trace costs the training thread on llama-tiny (the cost case's model and
    context, a 2,048-token vocabulary, one thread): inner steps with and without a
    :class:`node.checks.trace.Tracer` in windows of ``window``, alternating (ABBA, ``repeats``
    times), and one start state's copy and hash timed apart."""
    import torch

    from node.checks.trace import Tracer, TraceSettings
    from node.data.corpus import BatchStream
    from node.train.model import build_model
    from node.train.trainer import InnerTrainer
    from protocol.averaging.fragments import plan_fragments
    from verification.identity import Identity

    case = COST_CASES["llama-tiny"]
    cfg = load_config([str(_ROOT / case.config)], [*case.overrides, "model.vocab_size=2048"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg.model, seed=0)
        tokens = torch.randint(0, 2048, (1 << 20,), generator=torch.Generator().manual_seed(0))
        stream = BatchStream(
            tokens.to(torch.int16).view(torch.uint16), cfg.data.batch_size, cfg.model.context, "t"
        )
        trainer = InnerTrainer(model, cfg.train, stream)
        trainer.step()
        plan = plan_fragments(model, cfg.sync.fragments)
        tracer = Tracer(TraceSettings("probe", window, 1), Identity.from_seed(b"\x01" * 32), plan)

        timed: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for traced in (False, True, True, False):
                timed[traced].append(_trace_steps(trainer, tracer if traced else None, steps))
        params = list(model.parameters())
        timings = _state_timings(params, trainer.optimizer, tracer)
        tracer.close()
    finally:
        torch.set_num_threads(threads)
    without, with_ = statistics.fmean(timed[False]), statistics.fmean(timed[True])
    return {
        "model_params": sum(p.numel() for p in params),
        "window": window,
        "step_seconds_without": without,
        "step_seconds_with": with_,
        "step_ratio": with_ / without,
        **timings,
    }


def _trace_steps(trainer: Any, tracer: Any, steps: int) -> float:
    """Seconds per inner step of ``trainer`` over ``steps`` steps, traced by ``tracer``
    (None: untraced), the trace sealed and kept at the end."""
    began = time.perf_counter()
    for i in range(steps):
        if tracer is not None:
            tracer.before(trainer.model, trainer.optimizer, trainer.steps, (1, i))
        result = trainer.step()
        if tracer is not None:
            tracer.after(trainer.model, result.loss)
    if tracer is not None:
        tracer.seal()
        tracer.keep([])
    return (time.perf_counter() - began) / steps


def _state_timings(params: list, optimizer: Any, tracer: Any) -> dict[str, Any]:
    """One start state's size, and the seconds its copy and hash, its hash alone and the
    tracer's sketch of the parameters take."""
    from node.train.trainstate import Snapshot

    began = time.perf_counter()
    snapshot = Snapshot(params, optimizer)
    copy_and_hash = time.perf_counter() - began
    began = time.perf_counter()
    snapshot._hash()
    hash_only = time.perf_counter() - began
    began = time.perf_counter()
    tracer.sketcher.sketch(params)
    return {
        "start_state_bytes": snapshot.size,
        "copy_and_hash_seconds": copy_and_hash,
        "hash_seconds": hash_only,
        "sketch_seconds": time.perf_counter() - began,
    }
