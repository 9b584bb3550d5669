"""One piece of documents tokenized by a worker: cutting long texts between words, the
digest a finished piece is kept by, and the piece's files (the whole prepare:
test_prepare.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from node.data import prepare_tokens as pt


def test_a_long_text_is_cut_before_a_space_between_two_words() -> None:
    text = "alpha beta  gamma " * 50
    parts = list(pt.cut(text, 64))
    assert "".join(parts) == text and all(len(p) <= 64 for p in parts)
    # never inside a run of spaces, never inside a word
    for p, q in zip(parts, parts[1:]):
        assert q[0] == " " and q[1] != " " and p[-1] != " "
    assert list(pt.cut("x" * 130, 64)) == ["x" * 64, "x" * 64, "xx"]  # no space: at size
    assert list(pt.cut("short", 64)) == ["short"]


def test_the_digest_tells_pieces_apart_by_every_text_and_its_bounds() -> None:
    d = pt.digest_texts
    assert d(["ab", "c"]) == d(["ab", "c"])
    assert d(["ab", "c"]) != d(["a", "bc"]) != d(["ab", "d"])
    assert d(["x" * (pt.ENCODE_CHARS + 5)]) != d(["x" * (pt.ENCODE_CHARS + 6)])


@pytest.mark.parametrize("val_fraction", [0.0, 1.0])
def test_a_piece_of_bytes_is_written_with_its_counts_last(tmp_path: Path, val_fraction) -> None:
    setup = pt.WorkerSetup("", None, val_fraction, "uint8", str(tmp_path), 1 << 20)
    pt.load_worker(setup)
    try:
        counts = pt.tokenize_piece(3, ["héllo", "", "world"])
    finally:
        pt.clear_worker()
    split, other = ("val", "train") if val_fraction else ("train", "val")
    data = np.fromfile(tmp_path / f"piece-000003.{split}.bin", dtype=np.uint8)
    assert bytes(data) == "héllo".encode() + b"world"
    assert (tmp_path / f"piece-000003.{other}.bin").stat().st_size == 0
    assert counts[f"{split}_docs"] == 2 and counts[f"{split}_bytes"] == 11
    assert counts["empty"] == 1 and counts["digest"] == pt.digest_texts(["héllo", "", "world"])
    assert json.loads((tmp_path / "piece-000003.json").read_text()) == counts
