"""The shard files of ``atoll data prepare``: bytes split by file or by their tail, pieces
joined in order, and a corpus too small for two splits refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from node.data.prepare_shards import join_pieces, prepare_bytes
from node.data.sources import BYTES_DIGEST, SHARDS_FORMAT, DataError, is_val


def test_byte_shards_keep_each_file_whole_in_its_split(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for i in range(40):
        path = src / f"f{i:02d}.txt"
        path.write_bytes(bytes([65 + i % 26]) * (10 + i))
        files.append((path.as_posix(), path))
    out = tmp_path / "out"
    out.mkdir()
    meta = prepare_bytes(files, out, 0.2)
    val = b"".join(p.read_bytes() for rel, p in files if is_val(rel, 0.2))
    train = b"".join(p.read_bytes() for rel, p in files if not is_val(rel, 0.2))
    assert (out / "val.bin").read_bytes() == val and (out / "train.bin").read_bytes() == train
    assert meta["split"] == "file" and meta["tokenizer"] == {"digest": BYTES_DIGEST}
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == SHARDS_FORMAT and meta["train_tokens"] == len(train)


def test_one_file_is_split_by_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(1, 101)))  # no NUL byte: that would be a binary file
    out = tmp_path / "out"
    out.mkdir()
    meta = prepare_bytes([(path.as_posix(), path)], out, 0.1)
    assert (out / "train.bin").read_bytes() == bytes(range(1, 91))
    assert (out / "val.bin").read_bytes() == bytes(range(91, 101))
    assert (meta["train_tokens"], meta["val_tokens"]) == (90, 10)


def test_an_empty_corpus_is_too_little(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="too little"):
        prepare_bytes([(path.as_posix(), path)], tmp_path, 0.1)


def _piece(work: Path, index: int, train: list[int], val: list[int]) -> dict[str, int]:
    for split, tokens in (("train", train), ("val", val)):
        data = np.array(tokens, dtype=np.uint16).tobytes()
        (work / f"piece-{index:06d}.{split}.bin").write_bytes(data)
    return {
        "index": index,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "train_bytes": 3 * len(train),
        "val_bytes": 3 * len(val),
    }


def test_pieces_are_joined_in_order(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    counts = [_piece(work, 0, [1, 2], [9]), _piece(work, 1, [3], [8, 7])]
    meta = join_pieces(tmp_path, work, counts, "uint16", 0.1)
    train = np.frombuffer((tmp_path / "train.bin").read_bytes(), dtype=np.uint16).tolist()
    val = np.frombuffer((tmp_path / "val.bin").read_bytes(), dtype=np.uint16).tolist()
    assert (train, val) == ([1, 2, 3], [9, 8, 7])
    assert meta["split"] == "document" and meta["bytes_per_token"] == 3.0


def test_without_validation_documents_the_tail_is_held_out(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    counts = [_piece(work, 0, list(range(10)), [])]
    meta = join_pieces(tmp_path, work, counts, "uint16", 0.2)
    val = np.frombuffer((tmp_path / "val.bin").read_bytes(), dtype=np.uint16).tolist()
    assert meta["split"] == "tail" and val == [8, 9] and meta["train_tokens"] == 8
