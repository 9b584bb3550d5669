"""Where a corpus comes from and how it is split: shared by the node that reads a corpus
(:mod:`node.data.corpus`) and the command that prepares one (:mod:`node.data.prepare`).

Nothing here imports torch, so ``atoll data prepare``'s worker processes start fast.
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

__all__ = ["BYTES_DIGEST", "SHARDS_FORMAT", "SHARD_DTYPES", "DataError", "is_val", "user_files"]

BYTES_DIGEST = "bytes"
"""``data.tokenizer_digest`` of byte tokens (text read as UTF-8 bytes, no tokenizer)."""

SHARDS_FORMAT = "atoll-tokens/1"
"""``meta.json``'s ``format``: flat little-endian token files, one per split."""

SHARD_DTYPES: dict[str, int] = {"uint8": 256, "uint16": 65536, "uint32": 2**32}
"""Token types of shards, and how many distinct tokens each holds."""


class DataError(ValueError):
    """The corpus is empty, unreadable or too small for the model's context."""


def user_files(patterns: tuple[str, ...], key: str = "data.paths") -> list[tuple[str, Path]]:
    """The files ``patterns`` (paths or globs) name, as ``(posix path, path)``, sorted.

    Raises:
        DataError: a pattern that matches no regular file, naming ``key`` and the fix.
    """
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
            raise DataError(f"{key}: {pattern!r} matches no readable file{why}; {fix}")
        for f in files:
            out[f.as_posix()] = f
    return sorted(out.items())


def is_val(key: str, fraction: float) -> bool:
    """Whether the file or document ``key`` (a path, or a document's text) belongs to
    the validation split: a hash of it below ``fraction``, the same on every machine."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction
