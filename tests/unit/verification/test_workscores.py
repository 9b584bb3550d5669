"""What a record says (by hand), and each peer's standing: pooled over its records,
flagged only with confidence, never on one checker's word, weighted by its work."""

from __future__ import annotations

import math

import pytest

from verification.usefulness import CheckRecord
from verification.workscores import WORK_EXPONENT, Estimate, Scores, judge

ME = "me"


def _record(
    checker: str = "c1",
    round_: int = 4,
    gain: float = 0.2,
    ref_gain: float = 0.2,
    lift: float = 0.3,
    ref_lift: float = 0.3,
    claimed: int = 16,
    reference_claimed: int = 16,
    peer: str = "p",
) -> CheckRecord:
    """A record whose windows all gain alike (no spread) by the given amounts."""
    before = 3.0
    control = tuple((before, before - gain, before - ref_gain) for _ in range(4))
    assigned = tuple((before, before - gain - lift) for _ in range(4))
    reference_assigned = tuple((before, before - ref_gain - ref_lift) for _ in range(4))
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
        claimed=claimed,
        reference_claimed=reference_claimed,
        assigned=assigned,
        reference_assigned=reference_assigned,
        control=control,
    )


def test_a_record_by_hand() -> None:
    record = CheckRecord(
        **{
            **_record().__dict__,
            # (before, after, reference after): gains 0.1 and 0.2, the reference's 0.2
            "control": ((3.0, 2.9, 2.8), (3.2, 3.0, 3.0)),
            "assigned": ((3.0, 2.6), (3.0, 2.7)),  # gains 0.4 and 0.3
            "reference_assigned": ((3.0, 2.5), (3.0, 2.5)),  # 0.5
        }
    )
    verdict = judge(record)
    assert verdict.gain.mean == pytest.approx(0.15)
    assert verdict.gain.se == pytest.approx(math.sqrt(0.005) / math.sqrt(2))
    assert verdict.ref_gain.mean == pytest.approx(0.2) and verdict.ref_gain.se == 0
    assert verdict.lift.mean == pytest.approx(0.35 - 0.15)
    assert verdict.ref_lift.mean == pytest.approx(0.5 - 0.2)
    assert verdict.work == pytest.approx(0.15 / 0.2)
    assert verdict.specific == pytest.approx(0.2 / 0.3)
    # claiming five times the reference's batches scales the gain down by 5 ** 0.75
    more = judge(CheckRecord(**{**record.__dict__, "claimed": 80}))
    assert more.work == pytest.approx(0.75 * (16 / 80) ** WORK_EXPONENT)


def test_a_record_of_a_claim_no_one_can_draw_counts_as_no_work() -> None:
    verdict = judge(_record(claimed=0))
    assert verdict.work == 0.0 and verdict.specific == 0.0


def test_a_reference_that_did_not_clearly_gain_measures_nothing() -> None:
    assert judge(_record(ref_gain=0.0)).work is None
    assert judge(_record(ref_gain=-0.1)).work is None
    assert judge(_record(ref_lift=0.0)).specific is None
    noisy = Estimate.of([0.5, -0.4, 0.6, -0.5])  # mean 0.05, far under two errors
    assert noisy.mean == pytest.approx(0.05) and noisy.mean < 1.645 * noisy.se


def _scores(**kw) -> Scores:
    return Scores(ME, min_records=kw.pop("min_records", 4), min_work=0.5, min_specific=0.3, **kw)


def test_honest_records_never_fall_short_and_keep_full_weight() -> None:
    scores = _scores()
    for r, (g, lift) in enumerate([(0.2, 0.3), (0.25, 0.2), (0.15, 0.35), (0.22, 0.3)]):
        scores.add(_record(checker=f"c{r % 2}", round_=r, gain=g, lift=lift), judge(_record()))
    score = scores.score("p")
    assert not score["short"] and not score["flagged"] and score["factor"] == 1.0


@pytest.mark.parametrize(
    ("gain", "lift", "what"),
    [(0.0, 0.0, "zero"), (0.02, 0.3, "a tenth of the steps"), (0.2, 0.0, "copied")],
)
def test_a_peer_short_of_its_claim_is_flagged_on_four_records_from_two_checkers(
    gain: float, lift: float, what: str
) -> None:
    scores = _scores()
    for r in range(3):
        record = _record(checker=f"c{r % 2}", round_=r, gain=gain, lift=lift)
        assert scores.add(record, judge(record))
    assert scores.score("p")["short"] and not scores.score("p")["flagged"], what
    again = _record(checker="c0", round_=0, gain=gain, lift=lift)
    assert not scores.add(again, judge(again))  # the same record counts once
    last = _record(checker="c1", round_=3, gain=gain, lift=lift)
    scores.add(last, judge(last))
    assert scores.flagged() == {"p"}, what


def test_one_checker_cannot_get_a_peer_flagged_but_this_node_can() -> None:
    liar = _scores()
    for r in range(6):
        record = _record(checker="liar", round_=r, gain=0.0, lift=0.0)
        liar.add(record, judge(record))
    assert liar.score("p")["short"] and not liar.score("p")["flagged"]
    # with an honest checker's records beside the liar's: short on all of them, but not
    # once the liar's are left out
    for r in range(6):
        record = _record(checker="honest", round_=r)
        liar.add(record, judge(record))
    assert not liar.score("p")["flagged"]
    mine = _scores()
    for r in range(4):
        record = _record(checker=ME, round_=r, gain=0.0, lift=0.0)
        mine.add(record, judge(record))
    assert mine.flagged() == {"p"}


def test_weight_follows_the_pooled_work_ratio() -> None:
    scores = _scores()
    assert scores.factor("p") == 1.0  # no evidence yet: the claim stands
    for r in range(3):
        record = _record(checker=f"c{r}", round_=r, gain=0.08)  # 0.4 of the reference
        scores.add(record, judge(record))
    assert scores.factor("p") == pytest.approx(0.4 / 0.8)
    for r in range(3, 6):
        record = _record(checker=f"c{r}", round_=r, gain=0.0)
        scores.add(record, judge(record))
    assert scores.factor("p") == pytest.approx((3 * 0.08 / 6 / 0.2) / 0.8)


def test_only_the_newest_records_count() -> None:
    scores = _scores(window=4)
    for r in range(4):
        record = _record(checker=f"c{r % 2}", round_=r, gain=0.0, lift=0.0)
        scores.add(record, judge(record))
    assert scores.flagged() == {"p"}
    for r in range(4, 8):  # it did its work from then on
        record = _record(checker=f"c{r % 2}", round_=r)
        scores.add(record, judge(record))
    assert not scores.flagged() and scores.score("p")["records"] == 4
