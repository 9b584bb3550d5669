"""Replay the check records of ``robustness --checks`` runs through the scores under other
settings: how soon each attacker would have been flagged, and which honest peers.

``robustness --checks`` writes, beside its JSON, ``robustness-checks-records.json.gz``:
per run and honest node, every check record the node counted, in its order, and the
ends of its rounds (:func:`benchmarks._robustness_checks.check_log`). Feeding them to a
fresh :class:`verification.workscores.Scores` per node, with other thresholds, another
first checked round (records of earlier rounds are dropped) or other pooling constants,
answers what those settings would have flagged and when, without running the swarms
again. It is exact for what the settings see, with one limit: a peer flagged in the
real run sat out its quarantine, so records of it after its real flag are missing, and
settings that would flag it later than the run did cannot be judged on it.

    python -m benchmarks._checks_replay RECORDS [--grid]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from verification import workscores
from verification.gains import Estimate, Verdict
from verification.workscores import Scores

__all__ = ["Setting", "replay_node", "replay_runs", "main"]


@dataclass(frozen=True)
class Setting:
    """What the replay varies: the policy's thresholds and first checked round, and the
    scores' pooling constants."""

    from_round: int = 3
    min_records: int = 4
    min_work: float = 0.5
    min_specific: float = 0.7
    min_rounds: int = workscores.MIN_ROUNDS
    z: float = workscores.Z
    rounds: int | None = 3
    clip: float | None = workscores.CLIP


@dataclass(frozen=True)
class _Record:
    checker: str
    peer: str
    round: int
    fragment: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return self.checker, self.peer, self.round, self.fragment


@contextlib.contextmanager
def _constants(setting: Setting) -> Iterator[None]:
    saved = workscores.MIN_ROUNDS, workscores.Z
    workscores.MIN_ROUNDS, workscores.Z = setting.min_rounds, setting.z
    try:
        yield
    finally:
        workscores.MIN_ROUNDS, workscores.Z = saved


def _estimate(mean: float | None, se: float | None) -> Estimate | None:
    return None if mean is None else Estimate(mean, se or 0.0)


def replay_node(entries: list[list], setting: Setting) -> dict[int, int]:
    """Per peer index, the first round at whose end the scores fed ``entries`` flag it."""
    scores = Scores(
        setting.min_records,
        setting.min_work,
        setting.min_specific,
        rounds=setting.rounds,
        clip=setting.clip,
    )
    first: dict[int, int] = {}
    pending: set[int] = set()
    with _constants(setting):
        for entry in entries:
            if entry[0] == "r":
                for peer in pending:
                    first.setdefault(peer, entry[1])
                pending.clear()
                continue
            _, checker, peer, round_, fragment, claimed, *m = entry
            if round_ < setting.from_round:
                continue
            gain, ref_gain, lift, ref_lift = (_estimate(m[i], m[i + 1]) for i in range(0, 8, 2))
            if gain is None:
                continue
            verdict = Verdict(gain, ref_gain, lift, ref_lift)
            record = _Record(str(checker), str(peer), round_, fragment)
            if scores.add(record, verdict) and scores.score(str(peer))["flagged"]:
                pending.add(peer)
    return first


def replay_runs(runs: list[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    """Per attacked run the rounds until every honest node flagged each attacker (None:
    some never did), and over every run the honest peers flagged, as ``[run, by, peer,
    round]``."""
    attacks: dict[str, list[int | None]] = {}
    honest_flagged: list[list] = []
    for run in runs:
        if not run.get("log"):
            continue
        nodes, count = run["nodes"], run["byzantine"] or 0
        attackers = set(range(nodes - count, nodes))
        firsts = {int(i): replay_node(entries, setting) for i, entries in run["log"].items()}
        for i, flagged in firsts.items():
            for peer, r in flagged.items():
                if peer not in attackers and peer >= 0 and peer != i:
                    honest_flagged.append([run["name"], i, peer, r])
        for a in sorted(attackers):
            got = [f.get(a) for f in firsts.values()]
            when = max(got) if got and all(r is not None for r in got) else None
            attacks.setdefault(run["name"], []).append(when)
    return {"setting": asdict(setting), "attacks": attacks, "honest_flagged": honest_flagged}


def _grid() -> list[Setting]:
    out = []
    for from_round, rounds, min_records, z, work, specific in itertools.product(
        (2, 3), (None, 2, 3, 4), (2, 4), (1.28, 1.645), (0.5, 0.6), (0.7, 0.8)
    ):
        out.append(Setting(from_round, min_records, work, specific, 2, z, rounds))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._checks_replay")
    parser.add_argument(
        "records",
        help="robustness-checks-records.json.gz, or one in benchmarks/results/checks-records/",
    )
    parser.add_argument("--grid", action="store_true", help="try a grid of settings")
    args = parser.parse_args(argv)
    with gzip.open(args.records, "rt") as f:
        runs = json.load(f)["runs"]
    settings = _grid() if args.grid else [Setting()]
    for setting in settings:
        result = replay_runs(runs, setting)
        attacks = "  ".join(f"{k}: {v}" for k, v in result["attacks"].items())
        print(json.dumps(result["setting"]), f"honest {len(result['honest_flagged'])}", attacks)


if __name__ == "__main__":
    main()
