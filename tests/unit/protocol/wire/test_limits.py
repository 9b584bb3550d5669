"""The shared msgpack bounds: every way untrusted bytes can be too big or odd is one ValueError."""

from __future__ import annotations

import msgpack
import pytest

from protocol.wire._limits import bounded_unpackb, count_items


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_plain_values_decode_unchanged():
    value = {"a": [1, 2, {"b": b"\x00\x01"}], "c": "text"}
    assert bounded_unpackb(_pack(value), max_container=8, max_str_len=16, max_items=16) == value


def test_many_small_containers_exceed_the_item_budget():
    value = [{} for _ in range(50)]
    data = _pack(value)
    assert count_items(value) == 100  # 50 slots + 50 empty maps, one item each
    assert bounded_unpackb(data, max_container=64, max_str_len=8, max_items=100) == value
    with pytest.raises(ValueError, match="more than 99 items"):
        bounded_unpackb(data, max_container=64, max_str_len=8, max_items=99)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_pack(list(range(17))), "17 exceeds max_array_len"),
        (_pack({str(i): i for i in range(17)}), "17 exceeds max_map_len"),
        (_pack("x" * 9), "9 exceeds max_str_len"),
        (_pack({1: "int key"}), "not allowed for map key"),
        (msgpack.packb(msgpack.ExtType(5, b"zz")), "ext"),
        (b"\xc1", "FormatError"),  # never-used type byte
        (_pack([1, 2])[:-1], "Unpack"),  # truncated
    ],
)
def test_each_bad_input_is_one_value_error(data: bytes, reason: str):
    with pytest.raises(ValueError, match=reason):
        bounded_unpackb(data, max_container=16, max_str_len=8)


def test_a_binary_cannot_claim_more_bytes_than_the_input_holds():
    data = b"\xc6" + (2**31).to_bytes(4, "big") + b"abc"  # bin32 claiming 2 GiB
    with pytest.raises(ValueError):
        bounded_unpackb(data, max_container=16, max_str_len=8)
