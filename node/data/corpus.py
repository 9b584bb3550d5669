"""Text data for the reference workload, read as raw bytes; or token shards on disk.

The default corpus is the ``.py`` files of the running Python's standard library,
found at run time through :mod:`sysconfig` (nothing is downloaded or vendored). Files
are taken in a deterministic order and split into train and validation *by file*
with a hash of each file's relative path, so the split is the same on every machine
that has the file. Each node samples training windows from its own deterministic
stream (seeded by run seed and node key); validation batches are fixed so that every
node and every method reports comparable bits per byte.

At site scale the corpus does not fit in memory: ``atoll data prepare``
(:mod:`node.data.prepare`) writes it once as token shards (``train.bin`` and ``val.bin``,
flat little-endian ``uint8``, ``uint16`` or ``uint32`` tokens, and ``meta.json``), and
nodes read them through memory maps (:func:`load_shards`, ``data.shards = DIR``), so
only the windows a node samples are ever paged in. ``meta.json`` also says how many
bytes of text a validation token stands for, so validation loss is reported in bits
per byte whatever the tokenizer (:func:`bits_per_byte`). Slice ``data.site`` of ``data.sites`` of the train
tokens (:func:`slice_bounds`) is this node's: contiguous slices, disjoint, covering
the corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.config import DataConfig
from node.data.sources import (
    BYTES_DIGEST,
    SHARD_DTYPES,
    SHARDS_FORMAT,
    DataError,
    is_val,
    user_files,
)

__all__ = [
    "SHARDS_FORMAT",
    "BatchStream",
    "Corpus",
    "DataError",
    "assigned_stream",
    "bits_per_byte",
    "load_corpus",
    "load_data",
    "load_shards",
    "read_meta",
    "site_slice",
    "slice_bounds",
    "stdlib_files",
    "validation_batches",
]

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TOKEN_DTYPES = (torch.uint8, torch.uint16, torch.uint32)


@dataclass(frozen=True)
class Corpus:
    """Train and validation tokens as flat ``uint8`` (bytes), ``uint16`` or ``uint32``
    tensors (memory-mapped when read from shards).

    Attributes:
        bytes_per_token: bytes of text per validation token (1 for bytes).
        tokenizer: ``meta.json``'s tokenizer entry (its ``digest`` is ``"bytes"`` for
            bytes), and ``folder``: where the tokenizer files are, if any.
    """

    train: torch.Tensor
    val: torch.Tensor
    files: int
    bytes_per_token: float = 1.0
    tokenizer: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        assert self.train.dtype in _TOKEN_DTYPES
        assert self.val.dtype == self.train.dtype
        assert self.bytes_per_token > 0


def stdlib_files() -> list[tuple[str, Path]]:
    """The standard library's ``.py`` files as ``(relative posix path, path)``, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    # the excluded folders are not entered at all: site-packages alone holds most of
    # the files under the standard library's folder, and every node reads this list
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        rel = Path(folder).relative_to(root)
        out.extend(((rel / f).as_posix(), Path(folder, f)) for f in files if f.endswith(".py"))
    out.sort(key=lambda item: item[0])
    return out


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(
            f"cannot read corpus file {path} ({exc.strerror}); fix its permissions or "
            "leave it out of data.paths"
        ) from None


def load_data(cfg: DataConfig, context: int, vocab_size: int = 0) -> Corpus:
    """The configured corpus: token shards (``data.shards``) or text files.

    Args:
        vocab_size: the model's vocabulary (0: 256, the byte model's).
    """
    vocab_size = vocab_size or 256
    if cfg.shards:
        return load_shards(cfg.shards, context, vocab_size)
    if vocab_size < 256:
        raise DataError(
            f"model.vocab_size = {vocab_size} is too small for a text corpus read as "
            "bytes (256 values)"
        )
    return load_corpus(cfg, context)


def load_corpus(cfg: DataConfig, context: int) -> Corpus:
    """Read the configured corpus and split it into train and validation bytes.

    Args:
        cfg: data settings; empty ``paths`` selects the standard library.
        context: the model's context length; each split must hold at least one window.

    Raises:
        DataError: no files, unreadable files, or too little text for one window.
    """
    files = user_files(cfg.paths) if cfg.paths else stdlib_files()
    if cfg.max_files:
        files = files[: cfg.max_files]
    if not files:
        raise DataError("the corpus is empty: no files found; list text files in data.paths")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for rel, path in files:
        (val_parts if is_val(rel, cfg.val_fraction) else train_parts).append(_read(path))
    if not train_parts or not val_parts:
        # Too few files for a by-file split: split the bytes instead, tail to validation.
        blob = b"".join(train_parts + val_parts)
        cut = int(len(blob) * (1.0 - cfg.val_fraction))
        train_parts, val_parts = [blob[:cut]], [blob[cut:]]
    splits = {"train": b"".join(train_parts), "validation": b"".join(val_parts)}
    for name, data in splits.items():
        # A window is context + 1 bytes (inputs and the targets shifted by one).
        if len(data) < context + 1:
            where = f"data.paths {list(cfg.paths)}" if cfg.paths else "the standard library"
            total = sum(len(d) for d in splits.values())
            raise DataError(
                f"too little text for one context window in {where} ({len(files)} files, "
                f"{total} bytes): the {name} split has {len(data)} bytes, fewer than one "
                f"window of model.context + 1 = {context + 1}; add more text to data.paths "
                "or lower model.context"
            )
    train = torch.frombuffer(bytearray(splits["train"]), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(splits["validation"]), dtype=torch.uint8)
    return Corpus(train=train, val=val, files=len(files), tokenizer={"digest": BYTES_DIGEST})


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The checked ``meta.json`` of a shards folder (``data.shards``).

    Raises:
        DataError: a missing or malformed ``meta.json``.
    """
    root = Path(directory).expanduser()
    where = f"data.shards = {str(directory)!r}"
    try:
        meta = json.loads((root / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(
            f"{where}: no meta.json there; write shards with `atoll data prepare`"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{where}: cannot read meta.json ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARDS_FORMAT:
        raise DataError(f"{where}: meta.json is not {SHARDS_FORMAT!r} shards")
    dtype_name = meta.get("dtype")
    if dtype_name not in SHARD_DTYPES:
        raise DataError(f"{where}: dtype {dtype_name!r}, expected uint8, uint16 or uint32")
    limit = SHARD_DTYPES[dtype_name]
    vocab = meta.get("vocab_size", limit)
    if not isinstance(vocab, int) or not 2 <= vocab <= limit:
        raise DataError(f"{where}: vocab_size {vocab!r} does not fit {dtype_name}")
    tokenizer = meta.get("tokenizer", {"digest": BYTES_DIGEST})
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("digest"), str):
        raise DataError(f"{where}: meta.json's tokenizer entry has no digest")
    per_token = meta.get("bytes_per_token", 1.0)
    if not isinstance(per_token, (int, float)) or not per_token > 0:
        raise DataError(f"{where}: bytes_per_token {per_token!r} is not a positive number")
    return meta


def load_shards(directory: str | Path, context: int, vocab_size: int) -> Corpus:
    """Memory-map the shards ``atoll data prepare`` (or any tool writing the same
    layout) left in ``directory``.

    Raises:
        DataError: a missing or malformed ``meta.json``, a shard whose size does not
            match it, tokens the model's vocabulary cannot hold, or a split shorter than
            one window.
    """
    root = Path(directory).expanduser()
    where = f"data.shards = {str(directory)!r}"
    meta = read_meta(directory)
    dtype_name = meta["dtype"]
    dtype = np.dtype(dtype_name).newbyteorder("<")
    vocab = meta.get("vocab_size", SHARD_DTYPES[dtype_name])
    if vocab > vocab_size:
        raise DataError(
            f"{where}: tokens go up to {vocab - 1} but model.vocab_size = {vocab_size}; "
            f"set model.vocab_size = {vocab}"
        )
    splits = {}
    for name, key in (("train", "train_tokens"), ("val", "val_tokens")):
        path = root / f"{name}.bin"
        tokens = meta.get(key)
        if not isinstance(tokens, int) or tokens < 0:
            raise DataError(f"{where}: meta.json has no token count {key}")
        try:
            size = path.stat().st_size
        except OSError:
            raise DataError(f"{where}: {path.name} is missing") from None
        if size != tokens * dtype.itemsize:
            raise DataError(
                f"{where}: {path.name} holds {size} bytes, meta.json says {tokens} "
                f"{dtype_name} tokens"
            )
        if tokens < context + 1:
            raise DataError(
                f"{where}: the {name} split has {tokens} tokens, fewer than one window of "
                f"model.context + 1 = {context + 1}"
            )
        mapped = np.memmap(path, dtype=dtype, mode="r")
        with warnings.catch_warnings():  # read-only on purpose: nothing writes to it
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            splits[name] = torch.from_numpy(mapped)
    files = meta.get("files", 0)
    tokenizer = dict(meta.get("tokenizer", {"digest": BYTES_DIGEST}))
    if tokenizer.get("folder"):
        tokenizer["folder"] = str(root / str(tokenizer["folder"]))
    return Corpus(
        splits["train"],
        splits["val"],
        files if isinstance(files, int) else 0,
        bytes_per_token=float(meta.get("bytes_per_token", 1.0)),
        tokenizer=tokenizer,
    )


def slice_bounds(tokens: int, index: int, count: int) -> tuple[int, int]:
    """Tokens ``[lo, hi)`` of slice ``index`` of ``count``: contiguous, disjoint, and
    together covering ``[0, tokens)``; sizes differ by at most one."""
    if not 0 <= index < count:
        raise ValueError(f"slice {index} of {count}")
    base, extra = divmod(tokens, count)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def site_slice(data: torch.Tensor, index: int, count: int, context: int) -> torch.Tensor:
    """Slice ``index`` of ``count`` of ``data`` (a view: nothing is read).

    Raises:
        DataError: the slice is shorter than one window.
    """
    lo, hi = slice_bounds(data.numel(), index, count)
    if hi - lo < context + 1:
        raise DataError(
            f"data.site {index} of data.sites {count}: a slice of {hi - lo} tokens is "
            f"shorter than one window of model.context + 1 = {context + 1}; use fewer "
            "sites or more data"
        )
    return data[lo:hi]


def _seed_from(*keys: object) -> int:
    digest = hashlib.sha256("/".join(str(k) for k in keys).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class BatchStream:
    """Random ``(inputs, targets)`` windows from one split, deterministic per key.

    Args:
        data: a flat ``uint8`` or ``uint16`` tensor (a memory map's view is read only
            where a window falls).
        batch_size: windows per batch.
        context: tokens per window.
        key: anything identifying this stream (seed, replica index, PeerID); two streams
            with the same key yield the same batches.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, context: int, key: object) -> None:
        self.data = data
        self.batch_size = batch_size
        self.context = context
        self.generator = torch.Generator().manual_seed(_seed_from("batches", key))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch as int64 ``(B, T)`` inputs and targets (shifted by one token)."""
        high = self.data.numel() - self.context - 1
        starts = torch.randint(0, high + 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.context + 1)
        windows = self.data[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def batches_at(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches this stream yields at ``indices`` (sorted, from its start): the
        ones between are drawn but not read."""
        out, at = [], 0
        high = self.data.numel() - self.context - 1
        for index in sorted(indices):
            while at < index:
                torch.randint(0, high + 1, (self.batch_size,), generator=self.generator)
                at += 1
            out.append(self.next())
            at += 1
        return out

    def fixed_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` batches from a fresh copy of this stream (for evaluation)."""
        clone = BatchStream.__new__(BatchStream)
        clone.data, clone.batch_size, clone.context = self.data, self.batch_size, self.context
        clone.generator = torch.Generator().manual_seed(self.generator.initial_seed())
        return [clone.next() for _ in range(count)]


def assigned_stream(
    data: torch.Tensor,
    batch_size: int,
    context: int,
    run_id: str,
    peer: str,
    round_: int,
    rank: int = 0,
) -> BatchStream:
    """The batches ``peer`` (its rank ``rank``, in a site) is assigned to train on in
    round ``round_`` of ``run_id``, from ``data`` (its slice of the train tokens): anyone
    holding the same tokens draws the same ones (useful-work checks)."""
    key: tuple = ("assigned", run_id, peer, int(round_))
    return BatchStream(data, batch_size, context, key if rank == 0 else (*key, int(rank)))


def validation_batches(
    val: torch.Tensor, batch_size: int, context: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out batches every evaluation uses: ``count`` batches of ``val``.

    They depend only on the split and the shapes, never on the run's seed, the node or
    the method, so every node of a run, every seed of a benchmark and every method
    compared is scored on the very same bytes.
    """
    return BatchStream(val, batch_size, context, "validation").fixed_batches(count)


def bits_per_byte(mean_nats: float, bytes_per_token: float = 1.0) -> float:
    """Convert a mean cross-entropy per token (nats) into bits per byte of text:
    ``nats per token / bytes per token / ln 2``, comparable across tokenizers."""
    return mean_nats / bytes_per_token / math.log(2)
