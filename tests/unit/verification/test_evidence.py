"""The rules of proof on plain records: equivocation, a bad owner, a framed owner."""

from __future__ import annotations

import pytest

from verification.errors import VerificationError
from verification.evidence import (
    SignedCommit,
    SignedResult,
    check_bad_owner,
    check_equivocation,
    embedded_commit,
    framing_commit,
    misstated,
)

CHEAT, OWNER, MEMBER = "cheat", "owner", "member"
D1, D2 = b"\x01" * 32, b"\x02" * 32


def _commit(sender: str, digests: dict[int, bytes], round_: int = 3, **kw) -> SignedCommit:
    content = kw.get("content", "update")
    wire = kw.get("wire", f"{sender}:{round_}:{content}:{sorted(digests.items())}".encode())
    return SignedCommit(sender, round_, 0, content, digests, wire)


def _result(contributors: list[str], digests: list[bytes], **kw) -> SignedResult:
    return SignedResult(
        OWNER, 3, 0, kw.get("part", 1), "update", contributors, digests, kw.get("commits")
    )


def test_two_differing_commitments_for_one_exchange_prove_equivocation() -> None:
    assert check_equivocation(_commit(CHEAT, {0: D1}), _commit(CHEAT, {0: D2}), CHEAT) == (3, 0)


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (_commit(CHEAT, {0: D1}, wire=b"again"), "agree"),
        (_commit(OWNER, {0: D2}), "not signed by the accused"),
        (_commit(CHEAT, {0: D2}, round_=4), "different exchanges"),
        (_commit(CHEAT, {0: D2}, content="weights"), "different exchanges"),
    ],
)
def test_commitments_that_do_not_prove_equivocation(second: SignedCommit, why: str) -> None:
    with pytest.raises(VerificationError, match=why) as info:
        check_equivocation(_commit(CHEAT, {0: D1}), second, CHEAT)
    assert info.value.reason == "bad_evidence"


def test_a_result_that_misstates_a_commitment_proves_a_bad_owner() -> None:
    result = _result([OWNER, MEMBER], [D2, D2])
    assert check_bad_owner(result, _commit(MEMBER, {1: D1}), OWNER) == (3, 0)


@pytest.mark.parametrize(
    ("result", "commit", "why"),
    [
        (_result([OWNER, MEMBER], [D2, D1]), _commit(MEMBER, {1: D1}), "matches"),
        (_result([OWNER], [D2]), _commit(MEMBER, {1: D1}), "does not name"),
        (_result([OWNER, MEMBER], [D2, D2], part=2), _commit(MEMBER, {1: D1}), "another"),
        (_result([OWNER, MEMBER], [D2, D2]), _commit(MEMBER, {1: D1}, round_=4), "another"),
        (_result("not a list", [D2]), _commit(MEMBER, {1: D1}), "does not name"),
    ],
)
def test_results_that_do_not_prove_a_bad_owner(result, commit, why: str) -> None:
    with pytest.raises(VerificationError, match=why):
        check_bad_owner(result, commit, OWNER)


def test_an_owner_cannot_accuse_itself_through_its_own_commitment() -> None:
    with pytest.raises(VerificationError, match="matches"):
        check_bad_owner(_result([OWNER, MEMBER], [D2, D1]), _commit(OWNER, {1: D1}), OWNER)


def test_the_commitment_an_owner_relied_on_is_read_from_its_result() -> None:
    used = b"signed commitment"
    assert embedded_commit(_result([OWNER, CHEAT], [D1, D2], commits=[b"", used]), CHEAT) == used
    assert embedded_commit(_result([OWNER, CHEAT], [D1, D2], commits=[b"", b""]), CHEAT) is None
    assert embedded_commit(_result([OWNER, CHEAT], [D1, D2], commits=[used]), CHEAT) is None
    assert embedded_commit(_result([OWNER, CHEAT], [D1, D2]), CHEAT) is None
    assert embedded_commit(_result([OWNER, CHEAT], [D1, D2], commits=[b"", used]), MEMBER) is None


def test_a_second_commitment_of_the_accuser_frames_it() -> None:
    shown = _commit(CHEAT, {1: D1})
    used = _commit(CHEAT, {1: D2})
    assert framing_commit(shown, [shown, _commit(CHEAT, {1: D1}, wire=b"same")]) is None
    assert framing_commit(shown, [_commit(CHEAT, {1: D2}, round_=4), used]) == used
    assert framing_commit(shown, []) is None


def test_only_this_nodes_own_entry_is_judged() -> None:
    assert misstated(MEMBER, {1: D1}, 1, [OWNER, MEMBER], [D2, D2])
    assert not misstated(MEMBER, {1: D1}, 1, [OWNER, MEMBER], [D2, D1])
    assert not misstated(MEMBER, {1: D1}, 1, [OWNER], [D2])  # not a contributor
    assert not misstated(MEMBER, None, 1, [OWNER, MEMBER], [D2, D2])  # never committed
    assert not misstated(MEMBER, {0: D1}, 1, [OWNER, MEMBER], [D2, D2])  # not to this part
