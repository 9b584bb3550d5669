"""What a record says (by hand), and each peer's standing: measured against its
rounds' references, pooled over its records, flagged only with confidence, never on one
checker's word, weighted by its work."""

from __future__ import annotations

import dataclasses
import math

import pytest

from verification.gains import WORK_EXPONENT, Estimate, Verdict, judge
from verification.usefulness import CheckRecord
from verification.workscores import (
    CLIP,
    MIN_POOLED,
    MIN_ROUNDS,
    Scores,
    Z,
    _ratio,
)

ME = "me"
HONEST = ("h1", "h2", "h3")


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
    fragment: int = 0,
) -> CheckRecord:
    """A record whose windows all gain alike (no spread) by the given amounts."""
    before = 3.0
    control = tuple((before, before - gain, before, before - ref_gain) for _ in range(4))
    assigned = tuple((before, before - gain - lift) for _ in range(4))
    reference_assigned = tuple((before, before - ref_gain - ref_lift) for _ in range(4))
    return CheckRecord(
        checker=checker,
        peer=peer,
        run="run",
        round=round_,
        fragment=fragment,
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


def _add(scores: Scores, **kw) -> bool:
    record = _record(**kw)
    return scores.add(record, judge(record))


def _honest_round(scores: Scores, round_: int, checker: str = "c0") -> None:
    """Honest peers' contributions to ``round_``, measured by ``checker`` (whose own
    contribution each record measures too): the round's reference."""
    for peer in HONEST:
        _add(scores, checker=checker, round_=round_, peer=peer)


def test_a_record_by_hand() -> None:
    record = CheckRecord(
        **{
            **_record().__dict__,
            # (before, after, reference before and after): gains 0.1 and 0.2, the
            # reference's 0.2
            "control": ((3.0, 2.9, 3.0, 2.8), (3.2, 3.0, 3.2, 3.0)),
            "assigned": ((3.0, 2.6), (3.0, 2.7)),  # gains 0.4 and 0.3
            "reference_assigned": ((3.0, 2.5), (3.0, 2.5)),  # 0.5
        }
    )
    verdict = judge(record)
    per_claim = 16**-WORK_EXPONENT
    assert verdict.gain.mean == pytest.approx(0.15 * per_claim)
    assert verdict.gain.se == pytest.approx(per_claim * math.sqrt(0.005) / math.sqrt(2))
    assert verdict.ref_gain.mean == pytest.approx(0.2 * per_claim) and verdict.ref_gain.se == 0
    # lifts are in nats, not scaled by the claim
    assert verdict.lift.mean == pytest.approx(0.35 - 0.15)
    assert verdict.ref_lift.mean == pytest.approx(0.5 - 0.2)
    # claiming five times the batches scales the gain down by 5 ** 0.75, the
    # reference's (its own claim) not at all
    more = judge(CheckRecord(**{**record.__dict__, "claimed": 80}))
    assert more.gain.mean == pytest.approx(verdict.gain.mean * 5**-WORK_EXPONENT)
    assert more.ref_gain == verdict.ref_gain


def test_a_record_of_a_claim_no_one_can_draw_counts_as_no_work() -> None:
    verdict = judge(_record(claimed=0))
    assert verdict.gain == Estimate(0.0, 0.0) and verdict.lift == Estimate(0.0, 0.0)
    assert verdict.ref_gain.mean > 0
    unreferenced = judge(_record(reference_claimed=0))
    assert unreferenced.ref_gain is None and unreferenced.ref_lift is None


def test_a_round_has_a_reference_once_enough_contributions_were_measured() -> None:
    scores = Scores(4, 0.5, 0.5)
    assert scores.reference(4) == (None, None)
    _add(scores, peer="h1")  # h1 and the checker's own: two contributions
    assert scores.reference(4) == (None, None) and MIN_POOLED == 3
    _add(scores, peer="h2", gain=0.4, lift=0.9)
    gain, lift = scores.reference(4)
    assert gain == pytest.approx(0.2 * 16**-WORK_EXPONENT) and lift == pytest.approx(0.3)
    assert scores.reference(5) == (None, None)  # references are per round


def test_a_round_whose_reference_did_not_gain_measures_nothing() -> None:
    scores = Scores(4, 0.5, 0.5)
    for peer in HONEST:
        _add(scores, peer=peer, gain=-0.1, ref_gain=-0.1)
    assert scores.relative(judge(_record(gain=0.0, ref_gain=-0.1)), 4) == (
        None,
        pytest.approx(1.0),
    )
    noisy = Estimate.of([0.5, -0.4, 0.6, -0.5])  # mean 0.05, far under two errors
    assert noisy.mean == pytest.approx(0.05) and noisy.mean < Z * noisy.se


def test_the_ratio_estimator_by_hand() -> None:
    # values 1 and 3 against references 2 and 2: ratio 1; their scatter about it
    # (1 - 2) ** 2 + (3 - 2) ** 2 = 2 over k - 1 = 1, times k = 2, over 4 ** 2
    pooled = _ratio([(1.0, 0.0, 2.0), (3.0, 0.0, 2.0)])
    assert pooled.ratio == pytest.approx(1.0)
    assert pooled.upper == pytest.approx(1.0 + Z * math.sqrt(4 / 16))
    # windows' errors larger than the scatter decide the interval
    wide = _ratio([(2.0, 4.0, 2.0), (2.0, 4.0, 2.0)])
    assert wide.upper == pytest.approx(1.0 + Z * math.sqrt(32 / 16))
    assert _ratio([]) is None


def _scores(**kw) -> Scores:
    return Scores(min_records=kw.pop("min_records", 4), min_work=0.5, min_specific=0.5, **kw)


def test_honest_records_never_fall_short_and_keep_full_weight() -> None:
    scores = _scores()
    for r, (g, lift) in enumerate([(0.2, 0.3), (0.25, 0.2), (0.15, 0.35), (0.22, 0.3)]):
        _honest_round(scores, r)
        _add(scores, checker=f"c{r % 2}", round_=r, gain=g, lift=lift)
    score = scores.score("p")
    assert not score["short"] and not score["flagged"] and score["factor"] == 1.0
    assert score["work"] == pytest.approx((0.2 + 0.25 + 0.15 + 0.22) / 0.8)


@pytest.mark.parametrize(
    ("gain", "lift", "what"),
    [(0.0, 0.0, "zero"), (0.02, 0.3, "a tenth of the steps"), (0.2, 0.0, "copied")],
)
def test_a_peer_short_of_its_claim_is_flagged_on_four_records_from_two_checkers(
    gain: float, lift: float, what: str
) -> None:
    scores = _scores()
    for r in range(4):
        _honest_round(scores, r)
    for r in range(3):
        assert _add(scores, checker=f"c{r % 2}", round_=r, gain=gain, lift=lift)
    assert scores.score("p")["short"] and not scores.score("p")["flagged"], what
    # the same record counts once
    assert not _add(scores, checker="c0", round_=0, gain=gain, lift=lift)
    _add(scores, checker="c1", round_=3, gain=gain, lift=lift)
    assert scores.flagged() == {"p"}, what
    assert not any(scores.score(h)["flagged"] for h in HONEST)


def test_records_of_rounds_without_a_reference_wait_for_one() -> None:
    scores = _scores()
    for r in range(4):
        _add(scores, checker=f"c{r % 2}", round_=r, gain=0.0, lift=0.0)
    assert scores.score("p")["work"] is None and not scores.flagged()
    for r in range(4):  # the rounds' other contributions are measured later
        _honest_round(scores, r, checker="c2")
    assert scores.flagged() == {"p"}


def test_one_checker_cannot_get_a_peer_flagged_not_even_this_node() -> None:
    liar = _scores()
    for r in range(6):
        _honest_round(liar, r)
        _add(liar, checker="liar", round_=r, gain=0.0, lift=0.0)
    assert liar.score("p")["short"] and not liar.score("p")["flagged"]
    # with an honest checker's records beside the liar's: short on all of them, but not
    # once the liar's are left out
    for r in range(6):
        _add(liar, checker="honest", round_=r)
    assert not liar.score("p")["flagged"]
    # this node's own records are one checker's too: short, and not flagged on them
    # alone, until a second checker's records agree
    mine = _scores()
    for r in range(4):
        _honest_round(mine, r)
        _add(mine, checker=ME, round_=r, gain=0.0, lift=0.0)
    assert mine.score("p")["short"] and mine.flagged() == set()
    _add(mine, checker="c2", round_=3, gain=0.0, lift=0.0)
    assert mine.flagged() == {"p"}


def test_flagged_peers_do_not_drag_the_reference_down() -> None:
    """Three peers of six do nothing; once flagged their contributions leave the
    rounds' references, and honest peers stay at a ratio of one."""
    scores = _scores()
    lazy = ("l1", "l2", "l3")
    for r in range(8):
        for peer in lazy:
            _add(scores, checker=f"c{r % 2}", round_=r, peer=peer, gain=0.0, lift=0.0)
        for peer in HONEST[:2]:
            _add(scores, checker=f"c{r % 2}", round_=r, peer=peer)
    assert scores.flagged() == set(lazy)
    for r in range(8):
        assert scores.reference(r)[0] == pytest.approx(0.2 * 16**-WORK_EXPONENT)
    assert scores.score("h1")["work"] == pytest.approx(1.0)


def test_weight_follows_the_pooled_work_ratio() -> None:
    scores = _scores()
    assert scores.factor("p") == 1.0  # no evidence yet: the claim stands
    for r in range(3):
        _honest_round(scores, r)
        _add(scores, checker=f"c{r}", round_=r, gain=0.08)  # 0.4 of the reference
    assert scores.factor("p") == pytest.approx(0.4 / 0.8)
    for r in range(3, 6):
        _honest_round(scores, r)
        _add(scores, checker=f"c{r}", round_=r, gain=0.0)
    assert scores.factor("p") == pytest.approx((3 * 0.08 / 6 / 0.2) / 0.8)


def test_only_the_newest_records_count() -> None:
    scores = _scores(window=4)
    for r in range(8):
        _honest_round(scores, r)
    for r in range(4):
        _add(scores, checker=f"c{r % 2}", round_=r, gain=0.0, lift=0.0)
    assert scores.flagged() == {"p"}
    for r in range(4, 8):  # it did its work from then on
        _add(scores, checker=f"c{r % 2}", round_=r)
    assert not scores.flagged() and scores.score("p")["records"] == 4


def test_with_a_rounds_window_an_early_round_stops_vetoing_a_flag() -> None:
    """A tenth of the work gains much in a fresh model's first rounds: its first checked
    round looks honest, and with every record kept that round vetoes a flag (leaving any
    other round out leaves it in); judged on its newest rounds only, it ages out."""
    flags = {}
    for rounds in (None, 3):
        scores = _scores(rounds=rounds)
        for r in range(4):
            _honest_round(scores, r)
        _add(scores, checker="c0", round_=0)  # the early round: as much as anyone
        _add(scores, checker="c1", round_=0)
        for r in range(1, 4):
            for fragment in (0, 1):
                _add(
                    scores, checker=f"c{fragment}", round_=r, gain=0.02, lift=0.0, fragment=fragment
                )
        flags[rounds] = scores.flagged()
        assert scores.score("p")["records"] == (8 if rounds is None else 6)
    assert flags == {None: set(), 3: {"p"}}


def test_records_are_held_within_the_clip_of_their_reference() -> None:
    scores = _scores()
    for r in range(2):
        _honest_round(scores, r)
    # a lift of 10 times the reference counts as 1 + CLIP times it, -8 times as 1 - CLIP
    _add(scores, checker="c0", round_=0, lift=3.0)
    _add(scores, checker="c1", round_=1, lift=-2.4)
    assert scores.score("p")["specific"] == pytest.approx(((1 + CLIP) + (1 - CLIP)) / 2)
    raw = _scores(clip=None)
    for r in range(2):
        _honest_round(raw, r)
    _add(raw, checker="c0", round_=0, lift=3.0)
    _add(raw, checker="c1", round_=1, lift=-2.4)
    assert raw.score("p")["specific"] == pytest.approx((10 - 8) / 2)


def test_one_records_figures_for_the_logs() -> None:
    scores = _scores()
    _honest_round(scores, 4)
    verdict = Verdict(Estimate(0.0, 0.0), lift=Estimate(0.3, 0.0))
    assert scores.relative(verdict, 4) == (0.0, pytest.approx(1.0))
    assert scores.short(verdict, 4)
    assert not scores.short(judge(_record()), 4)
    # a round without a reference yet: against the checker's own contribution
    halved = judge(_record(gain=0.1, lift=0.1))
    assert scores.relative(halved, 9) == (pytest.approx(0.5), pytest.approx(1 / 3))
    assert scores.short(halved, 9)
    assert scores.relative(Verdict(Estimate(0.0, 0.0)), 9) == (None, None)


def test_one_bad_round_is_not_a_habit() -> None:
    """Two checkers on two fragments give four records of one contribution in a round:
    enough records, but a flag waits for a second round's."""
    scores = _scores()
    for r in range(2):
        _honest_round(scores, r)
    for checker in ("c0", "c1"):
        for fragment in (0, 1):
            _add(scores, checker=checker, round_=0, gain=0.0, lift=0.0, fragment=fragment)
    assert scores.score("p")["short"] and not scores.flagged()
    assert scores.score("p")["records"] == 4 and MIN_ROUNDS == 2
    _add(scores, checker="c0", round_=1, gain=0.0, lift=0.0)
    assert scores.flagged() == {"p"}


def test_two_rounds_flag_only_when_each_falls_short_alone() -> None:
    """Over two rounds, leaving one round out leaves the other alone: a peer short in
    one round and honest in the other is not flagged, however short the pooled ratio."""
    scores = _scores()
    for r in range(2):
        _honest_round(scores, r)
    for checker in ("c0", "c1"):
        for fragment in (0, 1):
            _add(scores, checker=checker, round_=0, gain=0.0, lift=0.0, fragment=fragment)
    _add(scores, checker="c0", round_=1)
    score = scores.score("p")
    assert score["records"] == 5 and score["checkers"] == 2
    assert not score["flagged"] and not scores.flagged()


def _add_noisy(scores: Scores, spread: float, **kw) -> bool:
    """:func:`_add` with claimed windows whose lifts alternate ``±spread`` about ``lift``."""
    record = _record(**kw)
    assigned = tuple(
        (before, after + (spread if i % 2 else -spread))
        for i, (before, after) in enumerate(record.assigned)
    )
    record = dataclasses.replace(record, assigned=assigned)
    return scores.add(record, judge(record))


def test_one_round_cannot_decide_a_flag_however_many_records_it_has() -> None:
    """Seen in a clean member of a mixing swarm: four records of one round (two checkers,
    two fragments) with no lift on its batches, then two rounds' single records near an
    honest lift. Pooled, the round with the most records decided the specific ratio
    (three checkers, three rounds: flagged); with that round left out the member is not
    short, so it is not flagged."""
    scores = _scores()
    for r in range(4):
        _honest_round(scores, r)
    for checker in ("c0", "c1"):
        for fragment in (0, 1):
            _add_noisy(scores, 0.1, checker=checker, round_=1, lift=-0.3, fragment=fragment)
    _add_noisy(scores, 0.1, checker="c2", round_=2, lift=0.0)
    _add_noisy(scores, 0.1, checker="c0", round_=3, lift=0.2)
    score = scores.score("p")
    assert score["short"] and score["records"] == 6 and score["checkers"] == 3
    assert not score["flagged"] and not scores.flagged()
    # the same shortfall in three rounds is a habit, flagged
    habit = _scores()
    for r in range(4):
        _honest_round(habit, r)
        _add_noisy(habit, 0.1, checker=f"c{r % 2}", round_=r, lift=-0.3)
    assert habit.flagged() == {"p"}


def test_a_checker_proven_to_cheat_has_its_records_left_out() -> None:
    """A zero member's own records (the loss its victim's contribution seemed to lose on
    its shrunken copy) supplied the second checker an honest peer's flag needed; once a
    failed replay or sent check proves the cheat here, its records count for nothing."""
    scores = _scores()
    for r in range(4):
        _honest_round(scores, r)
        _add(scores, checker=f"c{r % 2}", round_=r, gain=0.0, lift=0.0)
    assert scores.flagged() == {"p"}
    assert scores.replay_failed("c1", "c0", 3, proven=False) is False
    assert scores.flagged() == {"p"}  # one checker's word proves nothing
    assert scores.replay_failed("c1", "me", 3, proven=True)
    assert scores.flagged() == {"c1"}
    assert scores.score("p")["checkers"] == 1 and not scores.score("p")["flagged"]
