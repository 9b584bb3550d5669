"""Text data for the reference workload, read as raw bytes.

The default corpus is the ``.py`` files of the running Python's standard library,
found at run time through :mod:`sysconfig` (nothing is downloaded or vendored). Files
are taken in a deterministic order and split into train and validation *by file*
with a hash of each file's relative path, so the split is the same on every machine
that has the file. Each node samples training windows from its own deterministic
stream (seeded by run seed and node key); validation batches are fixed so that every
node and every method reports comparable bits per byte.
"""

from __future__ import annotations

import glob
import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from node.config import DataConfig

__all__ = ["Corpus", "DataError", "BatchStream", "bits_per_byte", "load_corpus", "stdlib_files"]

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The corpus is empty, unreadable or too small for the model's context."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes as flat ``uint8`` tensors."""

    train: torch.Tensor
    val: torch.Tensor
    files: int

    def __post_init__(self) -> None:
        assert self.train.dtype == torch.uint8 and self.val.dtype == torch.uint8


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


def _seed_from(*keys: object) -> int:
    digest = hashlib.sha256("/".join(str(k) for k in keys).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class BatchStream:
    """Random ``(inputs, targets)`` windows from one split, deterministic per key.

    Args:
        data: a flat ``uint8`` tensor.
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


def bits_per_byte(mean_nats: float) -> float:
    """Convert a mean cross-entropy over bytes (nats) into bits per byte."""
    return mean_nats / math.log(2)
