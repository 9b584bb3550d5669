"""The node's verifier: when a flagged peer stops being taken, and its audit trail."""

from __future__ import annotations

from pathlib import Path

import pytest

from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.verifier import Verifier

ME = Identity.from_seed(b"\x01" * 32).peer_id
PEER = Identity.from_seed(b"\x02" * 32).peer_id


@pytest.fixture
def verifier(tmp_path: Path):
    v = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME)
    yield v
    v.close()


def test_a_peer_flagged_mid_round_is_refused_from_the_next_round(verifier: Verifier) -> None:
    verifier.clock.start(4)
    # evidence about an older round arrives while this node is in round 4
    verifier.on_refusal(PEER, 3, 0, "non_finite")
    assert verifier.flagged(4) == {PEER: "quarantined"}
    # other honest members may not have seen it yet: round 4 goes on as they formed it
    assert verifier.refusal(PEER, 4) is None
    assert verifier.check_reduced(PEER, 4, 0, 0, _t([1.0, 2.0]), _t([1.0, 2.0])) is None
    assert verifier.excluded([PEER], 4) == set()
    # from round 5 on, its parts are left out and it votes to leave it out of the groups;
    # its results are still taken (and screened), as the other members still take them
    # until a majority has voted it out
    assert verifier.refusal(PEER, 5) == "quarantined"
    assert verifier.blocks(PEER, 5) is None
    assert verifier.excluded([PEER], 5) == {PEER}
    assert verifier.check_reduced(PEER, 5, 0, 0, _t([1.0, 2.0]), _t([1.0, 2.0])) is None


def test_a_banned_or_denied_peer_is_blocked(tmp_path: Path) -> None:
    v = Verifier(TrustPolicy(deny=(PEER,)), tmp_path / "a.db", ME)
    try:
        assert v.blocks(PEER, 1) == "denied"
        assert v.check_reduced(PEER, 1, 0, 0, _t([1.0]), _t([1.0])) == "denied"
    finally:
        v.close()
    v = Verifier(TrustPolicy(), tmp_path / "b.db", ME)
    try:
        v.convict(PEER, 2, 0, "equivocation")  # on_proof = ban
        assert v.blocks(PEER, 2) is None  # flagged this round: others may not know yet
        assert v.blocks(PEER, 3) == "banned"
    finally:
        v.close()


def test_owner_check_trusts_results_like_earlier_ones_and_skips_excluded_members(
    verifier: Verifier,
) -> None:
    own = _t([0.1, 0.0, 0.0, 0.0])
    normal = _t([1.0, 1.0, 1.0, 1.0])  # 20x this member's own update: a slow member
    assert verifier.check_reduced(PEER, 1, 0, 0, normal, own) == "owner_norm"
    for r in range(3):  # results of this size were accepted before, from other owners
        assert verifier.check_reduced(PEER, r, 0, 0, normal, normal) is None
    assert verifier.check_reduced(PEER, 4, 0, 0, normal, own) is None
    assert verifier.check_reduced(PEER, 4, 0, 0, normal * 10, own) == "owner_norm"
    # a result the owner computed without this member's part need not follow its
    # direction, but may be no longer than what honest owners returned before
    assert verifier.check_reduced(PEER, 4, 0, 0, -normal, own, included=False) is None
    assert verifier.check_reduced(PEER, 4, 0, 0, normal * 10, own, included=False) == "owner_norm"


def test_an_owner_that_left_this_member_out_cannot_hand_it_anything(verifier) -> None:
    own = _t([0.1, 0.1, 0.0, 0.0])
    # no history yet: the bound is norm_kappa times this member's own update
    assert verifier.check_reduced(PEER, 1, 0, 0, own * 100, own, included=False) == "owner_norm"
    assert verifier.check_reduced(PEER, 1, 0, 0, -own, own, included=False) is None


def test_benign_refusals_flag_no_one(verifier: Verifier) -> None:
    verifier.clock.start(2)
    for reason in ("late", "group_mismatch", "not_in_round", "busy", "timeout"):
        verifier.on_refusal(PEER, 2, 0, reason)
    assert verifier.flagged(3) == {}
    assert verifier.refusal(PEER, 3) is None
    rows = verifier.audit.rows(peer=PEER)
    assert [r.verdict for r in rows] == ["rejected"] * 5


def test_a_peer_quarantined_in_an_earlier_life_is_refused_at_once(tmp_path: Path) -> None:
    first = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME)
    first.clock.start(1)
    first.on_refusal(PEER, 1, 0, "bad_signature")
    first.close()
    # a restarted node has no in-memory record of when it saw the evidence
    again = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME)
    try:
        assert again.refusal(PEER, 2) == "quarantined"
        assert again.excluded([PEER], 2) == {PEER}
    finally:
        again.close()


def _t(values: list[float]):
    import torch

    return torch.tensor(values)


def _contribution(peer: str, values: list[float], tokens: int = 100):
    from verification.records import Contribution

    return Contribution(
        peer=peer, vector=_t(values), weight=float(tokens), digest="", tokens=tokens
    )


@pytest.mark.parametrize(
    ("partner", "reason"),
    [([50.0, 50.0, 0.0], "norm"), ([-1.0, -1.0, 0.0], "direction")],
)
def test_a_pair_screens_the_partner_against_its_own_part(
    verifier: Verifier, partner: list[float], reason: str
) -> None:
    own = _contribution(ME, [1.0, 1.0, 0.0])
    result = verifier.reducer.reduce(1, 0, 0, [own, _contribution(PEER, partner)])
    assert result.used == [ME]
    assert result.rejected[PEER] == reason
    torch_close(result.vector, [1.0, 1.0, 0.0])
    # two inputs have no robust centre: the partner is left out, not accused
    assert verifier.flagged(2) == {}


def test_an_honest_partner_is_averaged_in(verifier: Verifier) -> None:
    own = _contribution(ME, [1.0, 1.0, 0.0])
    result = verifier.reducer.reduce(1, 0, 0, [own, _contribution(PEER, [2.0, 1.0, 1.0])])
    assert sorted(result.used) == sorted([ME, PEER])
    torch_close(result.vector, [1.5, 1.0, 0.5])
    assert verifier.flagged(2) == {}


def test_an_idle_owner_judges_its_partner_by_the_norms_it_accepted_before(
    verifier: Verifier,
) -> None:
    for r in range(3):  # normal rounds: both around norm 1.4
        verifier.reducer.reduce(
            r, 0, 0, [_contribution(ME, [1.0, 1.0]), _contribution(PEER, [1.0, 1.2])]
        )
    idle = _contribution(ME, [0.0, 0.0])
    result = verifier.reducer.reduce(3, 0, 0, [idle, _contribution(PEER, [40.0, 40.0])])
    assert result.rejected[PEER] == "norm"


def torch_close(actual, expected: list[float]) -> None:
    import torch

    torch.testing.assert_close(actual, torch.tensor(expected))


def test_late_parts_of_a_past_round_cost_nothing(verifier: Verifier) -> None:
    verifier.clock.start(9)
    for _ in range(5):
        verifier.on_refusal(PEER, 3, 0, "stale_round")  # a frozen node woke up
        verifier.on_refusal(PEER, 9, 0, "too_slow")
    assert verifier.flagged(10) == {}
    assert verifier.reputation.standing(PEER, 10).violations == 0


def test_missed_deliveries_cost_only_when_committed_and_repeated(tmp_path: Path) -> None:
    v = Verifier(TrustPolicy(max_missed=3, missed_window=5), tmp_path / "atoll.db", ME)
    try:
        for r in range(1, 10):  # never committed: absent, never a violation
            v.on_missing(PEER, r, 0, 0, committed=False)
        v.on_missing(PEER, 1, 0, 0, committed=True)
        v.on_missing(PEER, 4, 0, 0, committed=True)
        v.on_missing(PEER, 7, 0, 0, committed=True)  # three, but round 1 left the window
        assert v.reputation.standing(PEER, 8).violations == 0
        v.on_missing(PEER, 8, 0, 0, committed=True)  # 4, 7, 8: three within five rounds
        standing = v.reputation.standing(PEER, 9)
        assert standing.violations == 1 and standing.status == "quarantined"
        reasons = [r.reason for r in v.audit.rows(peer=PEER)]
        assert reasons.count("absent") == 9 and reasons.count("no_delivery") == 4
        assert {r.verdict for r in v.audit.rows(peer=PEER)} == {"missing"}
        ok, _, _ = v.audit.verify()
        assert ok
    finally:
        v.close()


def test_a_peer_keeps_the_share_of_its_claim_its_checked_work_bears_out(tmp_path: Path) -> None:
    """With checks on, an update's weight is its claim scaled by its pooled work ratio
    (here records that measured half its rounds' reference work: a factor of 0.5 / 0.8),
    and a global copy's weight too; this node's own and the shared repairs every member
    reduces alike are weighted as before."""
    import torch

    from verification.gains import judge
    from verification.usefulness import CheckRecord

    v = Verifier(TrustPolicy(checkers=2, screening=False), tmp_path / "w.db", ME)
    try:
        for r in range(3):
            # the peer gains 0.1 where the checkers' own contributions and two other
            # peers' gain 0.2: the round's reference
            for peer, gain in ((PEER, 0.1), ("h1", 0.2), ("h2", 0.2)):
                control = tuple((3.0, 3.0 - gain, 3.0, 3.0 - 0.2) for _ in range(4))
                record = CheckRecord(
                    *(f"c{r}", peer, "run", r, 0, "a", "b", "c", "d", "e", 16, 16),
                    assigned=(),
                    reference_assigned=(),
                    control=control,
                )
                v.work.add(record, judge(record))
        assert v.work.factor(PEER) == pytest.approx(0.5 / 0.8)
        parts = [_contribution(ME, [0.0, 0.0]), _contribution(PEER, [1.0, 1.0])]
        factor = 0.5 / 0.8
        update = v.reducer.reduce(5, 0, 0, parts).vector
        torch.testing.assert_close(update, _t([factor / (1 + factor)] * 2))
        copies = v.reducer.reduce(5, 0, 0, parts, content="weights").vector
        torch.testing.assert_close(copies, _t([factor / (1 + factor)] * 2))
        shared = v.reducer.reduce(5, 0, 0, parts, shared=True).vector
        torch.testing.assert_close(shared, _t([0.5, 0.5]))
    finally:
        v.close()


def test_a_shrunken_copy_is_left_out_of_the_mix_and_its_holder_not_accused(
    verifier: Verifier,
) -> None:
    """A copy far below its group's norm is most often a victim's (an owner that lied
    shrank the mean it took): the mean leaves it out, and nobody is charged."""
    import torch

    others = [Identity.from_seed(bytes([i]) * 32).peer_id for i in (3, 4)]
    parts = [
        _contribution(ME, [1.0, 1.0]),
        _contribution(others[0], [1.2, 1.0]),
        _contribution(others[1], [1.0, 1.2]),
        _contribution(PEER, [0.1, 0.1]),
    ]
    mixed = verifier.reducer.reduce(5, 0, 0, parts, content="weights").vector
    torch.testing.assert_close(mixed, _t([3.2 / 3, 3.2 / 3]))
    assert verifier.reputation.standing(PEER, 5).violations == 0
    # the same norm in a pseudo-gradient is no offence either: an idle member's is zero
    update = verifier.reducer.reduce(5, 0, 0, parts).vector
    torch.testing.assert_close(update, _t([3.3 / 4, 3.3 / 4]))


def test_a_short_mean_of_copies_is_refused_and_its_owner_not_accused(verifier: Verifier) -> None:
    """An owner's mean of copies shorter than this member's copy and the means before is
    refused (the member keeps its own copy), but charges no one: an honest owner whose
    copy a zero owner shrank earlier returns one as short."""
    own = _t([1.0, 1.0, 1.0, 1.0])
    for r in (1, 2, 3):
        assert verifier.check_reduced(PEER, r, 0, 0, own, own, content="weights") is None
    verifier.clock.start(4)
    refused = verifier.check_reduced(PEER, 4, 0, 0, own * 0.5, own, content="weights")
    assert refused == "owner_shrunk"
    verifier.on_owner_refused(PEER, 4, 0, 0, refused)
    assert verifier.reputation.standing(PEER, 5).violations == 0
    assert [r.verdict for r in verifier.audit.rows(peer=PEER)] == ["owner_rejected"]
    # a refusal that is an offence still is
    verifier.on_owner_refused(PEER, 4, 0, 0, "owner_norm")
    assert verifier.reputation.standing(PEER, 5).violations == 1


def test_a_screened_outlier_is_left_out_at_once_and_charged_when_it_repeats(
    tmp_path: Path,
) -> None:
    """A contribution whose norm is far above the group's median is left out of every
    aggregate it fails, but with ``outlier_rounds = 2`` its sender is charged only in the
    second round it fails; deterministic refusals charge at once."""
    v = Verifier(TrustPolicy(quarantine_rounds=1, outlier_rounds=2), tmp_path / "atoll.db", ME)
    others = [Identity.from_seed(bytes([i]) * 32).peer_id for i in (3, 4, 5)]
    try:
        for round_ in (1, 2, 4):
            v.clock.start(round_)
            parts = [_contribution(p, [1.0, 1.0]) for p in (ME, *others)]
            parts.append(_contribution(PEER, [50.0, 50.0]))
            reduced = v.reducer.reduce(round_, 0, 0, parts)
            assert PEER not in reduced.used and reduced.rejected[PEER] == "norm"
            assert reduced.vector.tolist() == [1.0, 1.0]
            charged = v.reputation.standing(PEER, round_ + 1).violations
            assert charged == {1: 0, 2: 1, 4: 1}[round_], round_
        # quarantined for round 3; round 4 alone is a new first outlier (the two before
        # made one violation)
        assert v.flagged(2) == {PEER: "quarantined"} and v.flagged(4) == {}
        v.on_refusal(others[0], 4, 0, "not_finite")
        assert v.reputation.standing(others[0], 5).violations == 1
    finally:
        v.close()


def test_by_default_the_first_outlier_is_charged(tmp_path: Path) -> None:
    v = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME)
    try:
        v.on_owner_refused(PEER, 3, 0, 0, "owner_direction")
        assert v.reputation.standing(PEER, 4).violations == 1
    finally:
        v.close()


def test_a_gather_refuses_a_member_for_the_operators_lists_only(tmp_path: Path) -> None:
    # every member of a gather reduces the group's parts itself: a peer this node alone
    # banned is left out through its votes, not by its reduction, or values part ways
    denied = Identity.from_seed(b"\x03" * 32).peer_id
    v = Verifier(TrustPolicy(deny=(denied,)), tmp_path / "g.db", ME)
    try:
        v.convict(PEER, 2, 0, "equivocation")
        assert v.blocks(PEER, 3) == "banned" and v.listed(PEER, 3) is None
        assert v.listed(denied, 3) == "denied" and v.listed(ME, 3) is None
        parts = [_contribution(p, [1.0, 2.0]) for p in (ME, PEER, denied)]
        gathered = v.reducer.reduce(3, 0, 0, parts, shared=True, gathered=True)
        assert sorted(gathered.used) == sorted([ME, PEER]) and gathered.rejected == {
            denied: "denied"
        }
        shared = v.reducer.reduce(3, 0, 0, parts, shared=True)  # a repair still leaves it out
        assert sorted(shared.used) == [ME]
    finally:
        v.close()
