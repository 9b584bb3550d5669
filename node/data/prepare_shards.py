"""The shard files of ``atoll data prepare``: ``train.bin`` and ``val.bin``.

Byte corpora are copied file by file (:func:`prepare_bytes`); tokenized pieces are
joined in order (:func:`join_pieces`). A corpus too small to split by file or by
document holds out the tail of its tokens instead. Everything is
streamed in chunks, never held in memory whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from node.data.prepare_inputs import refuse_binary
from node.data.sources import BYTES_DIGEST, SHARDS_FORMAT, DataError, is_val
from verification.files import atomic_write

__all__ = ["join_pieces", "prepare_bytes"]

_COPY_BYTES = 1 << 22


def prepare_bytes(files: list[tuple[str, Path]], out: Path, val_fraction: float) -> dict:
    """Copy text files as byte tokens, split by a hash of their path (as
    :func:`node.data.corpus.load_corpus` splits them), file by file (never all in memory).

    Raises:
        DataError: a binary file (one holding NUL bytes, as the documents pipeline
            refuses it), or too little text for two splits.
    """
    paths = {"train": out / "train.bin", "val": out / "val.bin"}
    sizes = {"train": 0, "val": 0}
    with paths["train"].open("wb") as train, paths["val"].open("wb") as val:
        for rel, path in files:
            split = "val" if is_val(rel, val_fraction) else "train"
            sizes[split] += _append(path, train if split == "train" else val, text=True)
    if sizes["val"] == 0 or sizes["train"] == 0:
        # Too few files for a by-file split: the tail of the bytes goes to validation.
        _split_tail(paths, sizes, val_fraction, 1)
    if min(sizes.values()) == 0:
        raise DataError(
            f"{sum(sizes.values())} bytes of text in {len(files)} file(s): too little for "
            "a train and a validation split"
        )
    meta = {
        "format": SHARDS_FORMAT,
        "dtype": "uint8",
        "vocab_size": 256,
        "train_tokens": sizes["train"],
        "val_tokens": sizes["val"],
        "train_bytes": sizes["train"],
        "val_bytes": sizes["val"],
        "bytes_per_token": 1.0,
        "files": len(files),
        "val_fraction": val_fraction,
        "split": "file",
        "tokenizer": {"digest": BYTES_DIGEST},
    }
    atomic_write(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def _append(path: Path, sink: Any, text: bool = False) -> int:
    """Copy ``path`` to the end of ``sink`` in chunks; returns the bytes copied.
    ``text``: refuse a binary file."""
    written = 0
    try:
        with path.open("rb") as source:
            while chunk := source.read(_COPY_BYTES):
                if text:
                    refuse_binary(path, chunk)
                sink.write(chunk)
                written += len(chunk)
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path} ({exc.strerror})") from None
    return written


def _split_tail(
    paths: dict[str, Path], sizes: dict[str, int], val_fraction: float, itemsize: int
) -> None:
    """Move everything into train.bin, then its last ``val_fraction`` of tokens into
    val.bin (``sizes`` in bytes, cut on a token boundary)."""
    if sizes["val"]:
        with paths["train"].open("ab") as train, paths["val"].open("rb") as val:
            while chunk := val.read(_COPY_BYTES):
                train.write(chunk)
    total = sizes["train"] + sizes["val"]
    cut = int(total // itemsize * (1.0 - val_fraction)) * itemsize
    with paths["train"].open("r+b") as train, paths["val"].open("wb") as val:
        train.seek(cut)
        while chunk := train.read(_COPY_BYTES):
            val.write(chunk)
        train.truncate(cut)
    sizes["train"], sizes["val"] = cut, total - cut


def join_pieces(
    out: Path, work: Path, counts: list[dict[str, int]], dtype: str, val_fraction: float
) -> dict[str, Any]:
    """Join the pieces in ``work``, in order, into train.bin and val.bin; returns the
    shards' part of ``meta.json``."""
    paths = {"train": out / "train.bin", "val": out / "val.bin"}
    sizes = {}
    for split, path in paths.items():
        with path.open("wb") as sink:
            for c in counts:
                _append(work / f"piece-{c['index']:06d}.{split}.bin", sink)
        sizes[split] = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    tokens = {s: sum(c[f"{s}_tokens"] for c in counts) for s in paths}
    text_bytes = {s: sum(c[f"{s}_bytes"] for c in counts) for s in paths}
    split_rule = "document"
    if not tokens["train"] or not tokens["val"]:
        # Too few documents for a by-document split: the tail of the tokens is held out.
        _split_tail(paths, sizes, val_fraction, itemsize)
        per = sum(text_bytes.values()) / max(1, sum(tokens.values()))
        tokens = {s: sizes[s] // itemsize for s in paths}
        text_bytes = {s: round(tokens[s] * per) for s in paths}
        split_rule = "tail"
    if not tokens["train"] or not tokens["val"]:
        raise DataError(
            f"{sum(tokens.values())} tokens in all: too little for a train and a validation split"
        )
    return {
        "format": SHARDS_FORMAT,
        "dtype": dtype,
        "train_tokens": tokens["train"],
        "val_tokens": tokens["val"],
        "train_bytes": text_bytes["train"],
        "val_bytes": text_bytes["val"],
        "bytes_per_token": text_bytes["val"] / tokens["val"],
        "val_fraction": val_fraction,
        "split": split_rule,
    }
