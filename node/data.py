"""Text data for the reference workload, read as raw bytes; or token shards on disk.

The default corpus is the ``.py`` files of the running Python's standard library,
found at run time through :mod:`sysconfig` (nothing is downloaded or vendored). Files
are taken in a deterministic order and split into train and validation *by file*
with a hash of each file's relative path, so the split is the same on every machine
that has the file. Each node samples training windows from its own deterministic
stream (seeded by run seed and node key); validation batches are fixed so that every
node and every method reports comparable bits per byte.

At site scale the corpus does not fit in memory: ``atoll data prepare`` writes it once
as token shards (:func:`prepare_shards`: ``train.bin`` and ``val.bin``, flat
little-endian ``uint8`` or ``uint16`` tokens, and ``meta.json``), and nodes read them
through memory maps (:func:`load_shards`, ``data.shards = DIR``), so only the windows
a node samples are ever paged in. Slice ``data.site`` of ``data.sites`` of the train
tokens (:func:`slice_bounds`) is this node's: contiguous slices, disjoint, covering
the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from node.config import DataConfig

__all__ = [
    "SHARDS_FORMAT",
    "BatchStream",
    "Corpus",
    "DataError",
    "bits_per_byte",
    "load_corpus",
    "load_data",
    "load_shards",
    "prepare_shards",
    "site_slice",
    "slice_bounds",
    "stdlib_files",
    "validation_batches",
]

SHARDS_FORMAT = "atoll-tokens/1"
"""``meta.json``'s ``format``: flat little-endian token files, one per split."""
_SHARD_DTYPES = {"uint8": (np.uint8, 256), "uint16": (np.uint16, 65536)}
_COPY_BYTES = 1 << 22

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The corpus is empty, unreadable or too small for the model's context."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation tokens as flat ``uint8`` (bytes) or ``uint16`` tensors
    (memory-mapped when read from shards)."""

    train: torch.Tensor
    val: torch.Tensor
    files: int

    def __post_init__(self) -> None:
        assert self.train.dtype in (torch.uint8, torch.uint16)
        assert self.val.dtype == self.train.dtype


def stdlib_files() -> list[tuple[str, Path]]:
    """The standard library's ``.py`` files as ``(relative posix path, path)``, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        out.append((rel.as_posix(), path))
    out.sort(key=lambda item: item[0])
    return out


def _user_files(patterns: tuple[str, ...]) -> list[tuple[str, Path]]:
    out: dict[str, Path] = {}
    for pattern in patterns:
        expanded = Path(pattern).expanduser()
        matches = sorted(glob.glob(str(expanded), recursive=True))
        files = [Path(m) for m in matches if Path(m).is_file()]
        if not files:
            if glob.has_magic(str(expanded)):
                why, fix = "", "check the directory and the pattern"
            elif expanded.exists():
                why, fix = " (it is not a regular file)", "name files or a glob of files"
            else:
                why, fix = " (it does not exist)", "check the path"
            if not expanded.is_absolute():
                fix += f" (a relative path starts from {Path.cwd()})"
            raise DataError(f"data.paths: {pattern!r} matches no readable file{why}; {fix}")
        for f in files:
            out[f.as_posix()] = f
    return sorted(out.items())


def _is_val(rel: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(
            f"cannot read corpus file {path} ({exc.strerror}); fix its permissions or "
            "leave it out of data.paths"
        ) from None


def load_data(cfg: DataConfig, context: int, vocab_size: int = 256) -> Corpus:
    """The configured corpus: token shards (``data.shards``) or text files."""
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
    files = _user_files(cfg.paths) if cfg.paths else stdlib_files()
    if cfg.max_files:
        files = files[: cfg.max_files]
    if not files:
        raise DataError("the corpus is empty: no files found; list text files in data.paths")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for rel, path in files:
        (val_parts if _is_val(rel, cfg.val_fraction) else train_parts).append(_read(path))
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
    return Corpus(train=train, val=val, files=len(files))


def prepare_shards(patterns: Sequence[str], out: Path, val_fraction: float = 0.1) -> dict:
    """Write the text files ``patterns`` name as byte-token shards in ``out``.

    Files are split into train and validation by the same hash of their path as
    :func:`load_corpus`, and copied file by file (the corpus is never held in memory).
    Returns what ``meta.json`` says.

    Raises:
        DataError: no files, unreadable files, or too little text for a validation split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val fraction {val_fraction}: expected a number between 0 and 1")
    files = _user_files(tuple(patterns))
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.bin", "val": out / "val.bin"}
    sizes = {"train": 0, "val": 0}
    with paths["train"].open("wb") as train, paths["val"].open("wb") as val:
        for rel, path in files:
            split = "val" if _is_val(rel, val_fraction) else "train"
            sizes[split] += _append(path, train if split == "train" else val)
    if sizes["val"] == 0 or sizes["train"] == 0:
        # Too few files for a by-file split: the tail of the bytes goes to validation.
        _split_tail(paths, sizes, val_fraction)
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
        "files": len(files),
        "val_fraction": val_fraction,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _append(path: Path, sink: object) -> int:
    written = 0
    try:
        with path.open("rb") as source:
            while chunk := source.read(_COPY_BYTES):
                sink.write(chunk)  # type: ignore[attr-defined]
                written += len(chunk)
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path} ({exc.strerror})") from None
    return written


def _split_tail(paths: dict[str, Path], sizes: dict[str, int], val_fraction: float) -> None:
    """Move everything into train.bin, then its last ``val_fraction`` into val.bin."""
    if sizes["val"]:
        with paths["train"].open("ab") as train, paths["val"].open("rb") as val:
            while chunk := val.read(_COPY_BYTES):
                train.write(chunk)
    total = sizes["train"] + sizes["val"]
    cut = int(total * (1.0 - val_fraction))
    with paths["train"].open("r+b") as train, paths["val"].open("wb") as val:
        train.seek(cut)
        while chunk := train.read(_COPY_BYTES):
            val.write(chunk)
        train.truncate(cut)
    sizes["train"], sizes["val"] = cut, total - cut


def load_shards(directory: str | Path, context: int, vocab_size: int) -> Corpus:
    """Memory-map the shards :func:`prepare_shards` (or any tool writing the same
    layout) left in ``directory``.

    Raises:
        DataError: a missing or malformed ``meta.json``, a shard whose size does not
            match it, tokens the model's vocabulary cannot hold, or a split shorter than
            one window.
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
    if dtype_name not in _SHARD_DTYPES:
        raise DataError(f"{where}: dtype {dtype_name!r}, expected uint8 or uint16")
    dtype, limit = _SHARD_DTYPES[dtype_name]
    vocab = meta.get("vocab_size", limit)
    if not isinstance(vocab, int) or not 2 <= vocab <= limit:
        raise DataError(f"{where}: vocab_size {vocab!r} does not fit {dtype_name}")
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
        if size != tokens * np.dtype(dtype).itemsize:
            raise DataError(
                f"{where}: {path.name} holds {size} bytes, meta.json says {tokens} "
                f"{dtype_name} tokens"
            )
        if tokens < context + 1:
            raise DataError(
                f"{where}: the {name} split has {tokens} tokens, fewer than one window of "
                f"model.context + 1 = {context + 1}"
            )
        mapped = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        with warnings.catch_warnings():  # read-only on purpose: nothing writes to it
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            splits[name] = torch.from_numpy(mapped)
    files = meta.get("files", 0)
    return Corpus(splits["train"], splits["val"], files if isinstance(files, int) else 0)


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
        """The next batch as int64 ``(B, T)`` inputs and targets (shifted by one byte)."""
        high = self.data.numel() - self.context - 1
        starts = torch.randint(0, high + 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.context + 1)
        windows = self.data[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def fixed_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` batches from a fresh copy of this stream (for evaluation)."""
        clone = BatchStream.__new__(BatchStream)
        clone.data, clone.batch_size, clone.context = self.data, self.batch_size, self.context
        clone.generator = torch.Generator().manual_seed(self.generator.initial_seed())
        return [clone.next() for _ in range(count)]


def validation_batches(
    val: torch.Tensor, batch_size: int, context: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out batches every evaluation uses: ``count`` batches of ``val``.

    They depend only on the split and the shapes, never on the run's seed, the node or
    the method, so every node of a run, every seed of a benchmark and every method
    compared is scored on the very same bytes.
    """
    return BatchStream(val, batch_size, context, "validation").fixed_batches(count)


def bits_per_byte(mean_nats: float) -> float:
    """Convert a mean cross-entropy over bytes (nats) into bits per byte."""
    return mean_nats / math.log(2)
