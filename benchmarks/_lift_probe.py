"""The checks benchmark's lift probe: what the placebo does to a single record's lift.

A record's lift is what a contribution gains on windows of its claimed batches beyond
what it gains on control text. Measured that way alone, windows that any training helps
more than the control text add to every contribution's lift alike, and a member that
trained part of its claim looks closer to an honest one than it is. Records (version 3)
also measure the checker's own contribution on the same windows, the *placebo*, and
:func:`verification.workscores.judge` subtracts what it gains there.

The probe trains the checks benchmark's model (:data:`benchmarks._robustness_swarm.SMALL`)
for ``prior`` steps, then from that state 8 honest members (24 steps each on their own
assigned batches, as a round of the benchmark), 4 that train a tenth of their claim and
4 that train half, each the way ``--byzantine lazy`` does (the first steps, then
nothing). Each contribution is applied to one fragment, as a check applies it, and
measured on 16 windows of its claimed batches drawn as a checker draws them, with
another honest member as the placebo and 32 control windows; four draws per
contribution and fragment. It reports each kind's mean single-record ratio to the honest
median lift, with the placebo (the shipped statistic) and without (the one before), the
honest records' spread of that ratio, and each kind's separation from honest work.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
from typing import Any

__all__ = ["lift_probe"]

_STEPS = 24
_WINDOWS = 16
_HONEST = 8
_PARTIAL = 4
_DRAWS = 4


def lift_probe(priors: tuple[int, ...] = (24, 72, 144)) -> dict[str, Any]:
    """Single-record lift ratios with and without the placebo, after each of ``priors``
    steps of training (see the module docstring)."""
    import torch

    from benchmarks._robustness_swarm import SMALL
    from node.config import load_config
    from node.data import load_data
    from node.model import vocab_of

    cfg = load_config(None, [*SMALL, "train.total_steps=400"])
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    threads = torch.get_num_threads()
    out: dict[str, Any] = {
        "steps": _STEPS,
        "windows": _WINDOWS,
        "control_windows": 2 * _WINDOWS,
        "members": {"honest": _HONEST, "tenth": _PARTIAL, "half": _PARTIAL},
        "draws": _DRAWS,
        "by_prior": {},
    }
    try:
        torch.set_num_threads(1)
        for prior in priors:
            lifts = _Round(cfg, corpus, prior).lifts()
            out["by_prior"][str(prior)] = {how: _ratios(v) for how, v in lifts.items()}
    finally:
        torch.set_num_threads(threads)
    return out


class _Round:
    """One round's members trained from the state after ``prior`` steps."""

    def __init__(self, cfg: Any, corpus: Any, prior: int) -> None:
        from node.data import BatchStream
        from node.model import build_model
        from node.trainer import InnerTrainer
        from protocol.averaging.fragments import plan_fragments

        self.cfg, self.corpus, self.prior = cfg, corpus, prior
        self.batch, self.context = cfg.data.batch_size, cfg.model.context
        self.model = build_model(cfg.model, seed=0)
        self.plan = plan_fragments(self.model, 2)
        warm = BatchStream(corpus.train, self.batch, self.context, "warm")
        trainer = InnerTrainer(self.model, cfg.train, warm)
        for _ in range(prior):
            trainer.step()
        self.base = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        self.moments = copy.deepcopy(trainer.optimizer.state_dict())
        self.kinds = [(f"honest{i}", 1.0) for i in range(_HONEST)]
        self.kinds += [(f"tenth{i}", 0.1) for i in range(_PARTIAL)]
        self.kinds += [(f"half{i}", 0.5) for i in range(_PARTIAL)]
        self.after = {name: self._trained(name, share) for name, share in self.kinds}

    def _stream(self, name: str) -> Any:
        from node.data import assigned_stream

        train = self.corpus.train
        return assigned_stream(train, self.batch, self.context, "probe", name, self.prior)

    def _trained(self, name: str, share: float) -> dict[str, Any]:
        """Its values after ``share`` of the round's steps (the first ones)."""
        from node.trainer import InnerTrainer

        local = copy.deepcopy(self.model)
        local.load_state_dict({**local.state_dict(), **self.base})
        trainer = InnerTrainer(local, self.cfg.train, self._stream(name))
        trainer.optimizer.load_state_dict(copy.deepcopy(self.moments))
        trainer.steps = self.prior
        for _ in range(math.ceil(_STEPS * share)):
            trainer.step()
        return {k: v.detach().clone() for k, v in local.named_parameters()}

    def _losses(self, name: str, fragment: int, windows: Any) -> list[float]:
        """The windows' losses with ``name``'s values in ``fragment`` (the base's with
        no name)."""
        from node.trainer import window_losses

        values = dict(self.base)
        if name:
            for n in self.plan[fragment].names:
                values[n] = self.after[name][n]
        return window_losses(self.model, *windows, values)

    def _windows(self, name: str, rng: random.Random) -> Any:
        """Windows of ``name``'s claimed batches, one from each of 16 of them."""
        import torch

        batches = self._stream(name).batches_at(list(range(_STEPS)))
        picks = [(i, rng.randrange(self.batch)) for i in rng.sample(range(_STEPS), _WINDOWS)]
        return (
            torch.stack([batches[i][0][j] for i, j in picks]),
            torch.stack([batches[i][1][j] for i, j in picks]),
        )

    def lifts(self) -> dict[str, dict[str, list[float]]]:
        """Every record's lift by kind: with the placebo, and against control text only."""
        from node.data import BatchStream
        from verification.usefulness import CheckRecord
        from verification.workscores import judge

        honest = [name for name, share in self.kinds if share == 1.0]
        rng = random.Random(self.prior)
        out: dict[str, dict[str, list[float]]] = {"placebo": {}, "control_only": {}}
        for draw in range(_DRAWS):
            control = BatchStream(self.corpus.train, 2 * _WINDOWS, self.context, f"c{draw}")
            control_windows = control.next()
            for fragment in range(len(self.plan)):
                for name, _ in self.kinds:
                    placebo = rng.choice([h for h in honest if h != name])
                    rows = []
                    for windows in (self._windows(name, rng), control_windows):
                        before = self._losses("", fragment, windows)
                        after = self._losses(name, fragment, windows)
                        other = self._losses(placebo, fragment, windows)
                        rows.append(tuple(zip(before, after, before, other, strict=True)))
                    record = CheckRecord(
                        *("c", name, "probe", self.prior, fragment, "", "", "", "", ""),
                        claimed=_STEPS,
                        reference_claimed=_STEPS,
                        assigned=rows[0],
                        control=rows[1],
                    )
                    lift = judge(record).lift
                    assert lift is not None
                    gained = [[b - a for b, a, _, _ in r] for r in rows]
                    kind = name.rstrip("0123456789")
                    out["placebo"].setdefault(kind, []).append(lift.mean)
                    old = statistics.fmean(gained[0]) - statistics.fmean(gained[1])
                    out["control_only"].setdefault(kind, []).append(old)
        return out


def _ratios(lifts: dict[str, list[float]]) -> dict[str, float]:
    """Each kind's mean single-record lift over the honest median, the honest records'
    spread of that ratio, and each kind's separation from honest work in spreads."""
    reference = statistics.median(lifts["honest"])
    honest = [v / reference for v in lifts["honest"]]
    spread = statistics.stdev(honest)
    out = {"honest_median_lift": round(reference, 5), "honest_ratio_sd": round(spread, 3)}
    for kind in ("tenth", "half"):
        ratio = statistics.fmean(lifts[kind]) / reference
        out[f"{kind}_ratio"] = round(ratio, 3)
        # how many honest spreads one record puts between this kind and honest work
        out[f"{kind}_separation"] = round((1 - ratio) / spread, 3)
    return out
