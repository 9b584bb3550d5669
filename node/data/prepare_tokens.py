"""Tokenizing one piece of documents, in a worker process of ``atoll data prepare``
(:mod:`node.data.prepare` hands out the pieces and joins the results)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.data.sources import is_val
from verification.files import atomic_file, atomic_write

__all__ = [
    "ENCODE_CHARS",
    "WorkerSetup",
    "clear_worker",
    "cut",
    "digest_texts",
    "encode",
    "init_pool_worker",
    "load_worker",
    "tokenize_piece",
]

ENCODE_CHARS = 1 << 18
"""A worker tokenizes at most this much text at a time: ``tokenizers`` needs up to a few
hundred bytes per character of a text it is given."""


@dataclass(frozen=True)
class WorkerSetup:
    """What every tokenizing worker is started with."""

    tokenizer_json: str
    eos_id: int | None
    val_fraction: float
    dtype: str
    folder: str
    piece_bytes: int


_worker: dict[str, Any] = {}


def load_worker(setup: WorkerSetup) -> None:
    _worker["setup"] = setup
    _worker["tok"] = None
    if setup.tokenizer_json:
        from tokenizers import Tokenizer

        _worker["tok"] = Tokenizer.from_file(setup.tokenizer_json)


def init_pool_worker(setup: WorkerSetup) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool
    load_worker(setup)


def tokenize_piece(index: int, texts: list[str]) -> dict[str, Any]:
    """Tokenize one piece into ``piece-N.{train,val}.bin``; its counts and the digest of
    its documents go to ``piece-N.json``, written last, so a piece with a json is whole."""
    setup: WorkerSetup = _worker["setup"]
    folder = Path(setup.folder)
    (folder / f"piece-{index:06d}.json").unlink(missing_ok=True)  # another job's piece
    kept = [t for t in texts if t]
    counts: dict[str, Any] = {"index": index, "empty": len(texts) - len(kept)}
    for split in ("train", "val"):
        counts.update({f"{split}_docs": 0, f"{split}_tokens": 0, f"{split}_bytes": 0})
    arrays: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eos = np.asarray([] if setup.eos_id is None else [setup.eos_id], dtype=setup.dtype)
    tokens, sizes = encode(kept, min(setup.piece_bytes, ENCODE_CHARS))
    for text, doc, size in zip(kept, tokens, sizes):
        split = "val" if is_val(text, setup.val_fraction) else "train"
        arrays[split] += [*doc, eos]
        counts[f"{split}_docs"] += 1
        counts[f"{split}_tokens"] += sum(len(a) for a in doc) + len(eos)
        counts[f"{split}_bytes"] += size
    for split, parts in arrays.items():
        data = np.concatenate(parts) if parts else np.zeros(0, dtype=setup.dtype)
        with atomic_file(folder / f"piece-{index:06d}.{split}.bin", durable=False) as f:
            data.astype(np.dtype(setup.dtype).newbyteorder("<"), copy=False).tofile(f)
    counts["digest"] = digest_texts(texts)
    _write_json(folder / f"piece-{index:06d}.json", counts)
    return counts


def encode(texts: list[str], size: int) -> tuple[list[list[np.ndarray]], list[int]]:
    """Each text's tokens (arrays, in order) and its UTF-8 bytes. The tokenizer is given
    about ``size`` characters at a time, a longer text in parts (:func:`cut`), so its
    memory follows ``size``, not the longest text."""
    setup: WorkerSetup = _worker["setup"]
    tok = _worker["tok"]
    tokens: list[list[np.ndarray]] = [[] for _ in texts]
    sizes = [0] * len(texts)
    batch: list[tuple[int, str]] = []

    def flush() -> None:
        for i, part in batch:
            sizes[i] += len(part.encode("utf-8"))
        if tok is None:  # bytes
            ids: list[Any] = [np.frombuffer(p.encode("utf-8"), dtype=np.uint8) for _, p in batch]
        else:
            encoded = tok.encode_batch([p for _, p in batch], add_special_tokens=False)
            ids = [e.ids for e in encoded]
        for (i, _), part_ids in zip(batch, ids):
            tokens[i].append(np.asarray(part_ids, dtype=setup.dtype))
        batch.clear()

    held = 0
    for i, text in enumerate(texts):
        for part in cut(text, size):
            batch.append((i, part))
            held += len(part)
            if held >= size:
                flush()
                held = 0
    flush()
    return tokens, sizes


def cut(text: str, size: int) -> Iterator[str]:
    """``text`` in parts of at most ``size`` characters, each cut before a space between
    two words in the last half of that (so a tokenizer that splits words at spaces, as
    byte-level BPE and SentencePiece do, gives the tokens of the whole), else at
    ``size``."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind(" ", start + size // 2, end)
        while cut > start and not (text[cut - 1].strip() and text[cut + 1].strip()):
            cut = text.rfind(" ", start + size // 2, cut)
        cut = cut if cut > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


def digest_texts(texts: list[str]) -> str:
    """What a piece was made of: checked before a finished piece is kept."""
    h = hashlib.sha256()
    for text in texts:
        h.update(len(text).to_bytes(8, "little"))
        for i in range(0, len(text), ENCODE_CHARS):
            h.update(text[i : i + ENCODE_CHARS].encode("utf-8"))
    return h.hexdigest()


def clear_worker() -> None:
    """Forget the tokenizer of a worker that ran in this process."""
    _worker.clear()


def _write_json(path: Path, value: Any) -> None:
    atomic_write(path, json.dumps(value, indent=2) + "\n", durable=False)
