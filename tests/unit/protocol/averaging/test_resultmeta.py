"""The signed fields of an owner's result: written once, read back checked by a member,
and read as evidence exactly as signed."""

from __future__ import annotations

import pytest
import torch

from protocol.averaging.resultmeta import (
    head_fields,
    read_result,
    result_fields,
    signed_result,
    trailer_fields,
)
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from verification.records import Contribution

A, B = "12D3KooWa", "12D3KooWb"


def _kept() -> list[Contribution]:
    return [
        Contribution(A, torch.zeros(2), 1.0, b"a" * 32),
        Contribution(B, torch.zeros(2), 3.0, b"b" * 32),
    ]


def test_an_owner_signs_who_is_in_its_result_in_the_order_it_reduced_them() -> None:
    meta = result_fields("update", _kept(), {"c": "late"})
    assert meta == {
        "content": "update",
        "contributors": [A, B],
        "weights": [1.0, 3.0],
        "digests": [b"a" * 32, b"b" * 32],
        "rejected": {"c": "late"},
    }
    assert result_fields("update", _kept(), {}, commits=[b"x", b""])["commits"] == [b"x", b""]


def test_a_streamed_results_head_and_trailer_sign_the_fields_between_them() -> None:
    meta = result_fields("weights", _kept(), {})
    head, trailer = head_fields("weights"), trailer_fields(meta)
    assert head == {"content": "weights"} and "content" not in trailer
    assert {**head, **trailer} == meta


def test_a_member_reads_the_fields_back_checked() -> None:
    fields = read_result(result_fields("update", _kept(), {}), A, "update")
    assert fields.contributors == [A, B] and fields.weights == [1.0, 3.0]
    assert fields.digests == [b"a" * 32, b"b" * 32] and fields.rejected == {}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"content": "weights"}, "wrong_part"),
        ({"contributors": [A, 7]}, "malformed"),
        ({"weights": [1.0, -1.0]}, "malformed"),
        ({"weights": [True, 1.0]}, "malformed"),
        ({"digests": [b"a" * 32]}, "malformed"),
    ],
)
def test_fields_a_member_relies_on_are_refused_when_wrong(change: dict, reason: str) -> None:
    meta = {**result_fields("update", _kept(), {}), **change}
    with pytest.raises(ProtocolError) as info:
        read_result(meta, A, "update")
    assert info.value.reason == reason and info.value.peer == A


def test_evidence_is_read_as_signed_whatever_its_shape() -> None:
    header = Header("reduced", "run", 4, 2, 1, A)
    meta = {"content": "update", "contributors": "not a list", "digests": None}
    signed = signed_result(header, meta)
    assert (signed.owner, signed.round, signed.fragment, signed.part) == (A, 4, 2, 1)
    assert signed.contributors == "not a list" and signed.commits is None
