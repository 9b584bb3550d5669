"""The audit log's chain: each row's fields checked before it is appended, each row's
hash over the one before, and the walk that names the first row breaking the chain."""

from __future__ import annotations

import pytest

from verification.auditchain import (
    GENESIS_HASH,
    chain_hash,
    check_count,
    check_head,
    clean_rows,
    walk_chain,
)

ROW = {
    "round": 1,
    "fragment": 0,
    "part": 2,
    "sender": "12D3KooWpeer",
    "digest": b"\xab" * 32,
    "tokens": 5,
    "verdict": "accepted",
}


def _chain(n: int) -> list[tuple]:
    rows, prev = [], GENESIS_HASH
    for i in range(1, n + 1):
        values = (i, 1000.5 + i, 1, 0, 0, "peer", "ab" * 32, 5, "accepted", "")
        h = chain_hash(prev, values)
        rows.append((*values, prev, h))
        prev = h
    return rows


def test_rows_are_checked_and_normalized_before_they_are_appended() -> None:
    (row,) = clean_rows([ROW])
    assert row == (1, 0, 2, "12D3KooWpeer", "ab" * 32, 5, "accepted", "")
    assert clean_rows([{**ROW, "digest": "AB" * 32, "reason": "norm"}])[0][4:] == (
        "ab" * 32,
        5,
        "accepted",
        "norm",
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"verdict": "maybe"}, "verdict must be one of"),
        ({"sender": ""}, "sender must be a non-empty string"),
        ({"digest": "xyz"}, "digest must be bytes or a hex string"),
        ({"tokens": True}, "tokens must be an integer"),
        ({"round": -1}, "round must be >= 0"),
        ({"extra": 1}, "unknown fields \\['extra'\\]"),
    ],
)
def test_a_bad_row_is_refused_naming_its_index_and_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"row 1: .*{message}"):
        clean_rows([ROW, {**ROW, **change}])


def test_counts_are_non_negative_integers_and_never_bools() -> None:
    assert check_count("n", 3) == 3
    for bad in (False, 1.5, "3", -2):
        with pytest.raises(ValueError, match="^n must be"):
            check_count("n", bad)


def test_each_hash_covers_the_previous_one_and_every_field() -> None:
    values = (1, 1.5, 1, 0, 0, "peer", "ab", 5, "accepted", "")
    h = chain_hash(GENESIS_HASH, values)
    assert len(h) == 64 and h == chain_hash(GENESIS_HASH, values)
    assert chain_hash("1" * 64, values) != h
    assert chain_hash(GENESIS_HASH, (*values[:7], "5", *values[8:])) != h  # a type changed


def test_an_intact_chain_walks_to_its_end() -> None:
    rows = _chain(4)
    assert walk_chain(rows) == (4, rows[-1][-1], None)
    assert check_head([(4, rows[-1][-1], 4)], 4, rows[-1][-1]) is None


def test_the_walk_names_the_first_row_that_breaks_the_chain() -> None:
    rows = _chain(4)
    edited = list(rows)
    edited[2] = (*rows[2][:7], 500, *rows[2][8:])  # row 3's tokens changed
    checked, last_good, bad = walk_chain(edited)
    assert (checked, last_good) == (2, rows[1][-1]) and bad[0] == 3
    checked, _, bad = walk_chain([rows[0], rows[2]])  # row 2 deleted
    assert checked == 1 and bad == (3, "id gap: expected row 2")


def test_the_head_tells_a_truncated_log_from_a_mismatch() -> None:
    rows = _chain(3)
    last = rows[-1][-1]
    assert check_head([], 3, last) == (None, "audit head missing")
    assert check_head([(5, "x", 5)], 3, last) == (
        4,
        "truncated: head records 5 rows, log holds 3",
    )
    assert check_head([(3, "x" * 64, 3)], 3, last)[1].startswith("head mismatch")
