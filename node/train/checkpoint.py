"""Atomic, self-verifying checkpoints in a node's data directory.

A checkpoint is one file, ``ckpt-{round:08d}.pt``::

    b"ATOLLCK1" | sha256(payload) (32 bytes) | payload

where the payload is what :func:`torch.save` writes for the state dict. The digest
lets a restarting node tell a checkpoint that a crash, a full disk or bit rot has
damaged from a good one, and fall back to the previous checkpoint instead of
resuming from garbage.

Writes go to a temporary file in the same directory, are fsynced, and are moved into
place with :func:`os.replace`, after which the directory itself is fsynced; a reader
therefore sees either the previous set of checkpoints or the new one, never a
partial file under a final name. Loads use ``torch.load(weights_only=True)``, which
unpickles only tensors and plain containers, so a checkpoint cannot run code; model
and ``torch.optim`` state dicts (AdamW, SGD with momentum) load this way, and
:func:`save_checkpoint` refuses state that could not be loaded back.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verification.files import atomic_file

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

MAGIC = b"ATOLLCK1"
_DIGEST_SIZE = 32
HEADER_SIZE = len(MAGIC) + _DIGEST_SIZE
_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TMP_PREFIX = ".ckpt-"
_TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 20

# Types ``torch.load(weights_only=True)`` reads back (checked against torch 2.13; sets
# are left out because older releases refuse them). Exact type checks, because
# subclasses such as IntEnum or defaultdict are pickled by class and then refused.
_LEAF_TYPES = (type(None), bool, int, float, str, bytes, torch.Size, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(ValueError):
    """A checkpoint file is damaged, truncated, or not an Atoll checkpoint."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint on disk.

    Attributes:
        path: The checkpoint file.
        round: The training round it was taken at, from the file name.
        digest: Hex SHA-256 of the payload, as recorded in the file header.
    """

    path: Path
    round: int
    digest: str


def save_checkpoint(directory: Path, round: int, state: dict, *, keep: int = 3) -> CheckpointInfo:
    """Atomically write ``state`` as the checkpoint for ``round`` and prune old ones.

    After the new file is in place, only the newest ``keep`` checkpoints (by round)
    are kept, and temporary files left by interrupted earlier saves are removed; the
    file just written is never removed, even if newer rounds exist. This assumes one
    writer per directory, which holds because each node owns its data directory.

    Args:
        directory: The node's checkpoint directory; created if missing.
        round: The training round, ``>= 0``. Saving a round again replaces it.
        state: Tensors, ``torch.Size``/dtype/device, ``None``, bools, ints, floats,
            strings, bytes, and dicts, lists and tuples of these (model and
            optimizer ``state_dict()`` output fits).
        keep: How many checkpoints to keep, ``>= 1``.

    Returns:
        Where the checkpoint went, its round and its payload digest.

    Raises:
        ValueError: a negative round, ``keep < 1``, or state holding a type that
            ``torch.load(weights_only=True)`` could not read back.
        OSError: the write failed; no file is left under the final name and the
            earlier checkpoints are untouched.
    """
    if type(round) is not int or round < 0:
        raise ValueError(f"checkpoint round must be an int >= 0, got {round!r}")
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint state must be a dict, got {type(state).__name__}")
    _check_loadable(state, "state")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{round:08d}.pt"
    writer: _HashingWriter | None = None
    try:
        prefix = f"{_TMP_PREFIX}{round:08d}-"
        with atomic_file(final, prefix=prefix, suffix=_TMP_SUFFIX, perms=0o600) as f:
            # Stream the payload straight to disk, hashing on the way, so a large
            # state is not held in memory a second time as bytes.
            f.write(MAGIC + bytes(_DIGEST_SIZE))
            writer = _HashingWriter(f)
            torch.save(state, writer)
            digest = writer.sha256.digest()
            f.seek(len(MAGIC))
            f.write(digest)
    except BaseException as exc:
        # torch.save reports a failed write (a full disk) as a RuntimeError of its own;
        # the caller gets the OSError, naming the checkpoint it could not write.
        cause = writer.error if writer and not isinstance(exc, OSError) else None
        if cause is not None and cause.errno:
            raise OSError(cause.errno, cause.strerror, str(final)) from exc
        raise
    info = CheckpointInfo(path=final, round=round, digest=digest.hex())
    logger.info("checkpoint round %d written to %s (sha256 %s)", round, final, info.digest[:16])
    _prune(directory, keep, final)
    return info


def load_checkpoint(path: Path, *, map_location: str | torch.device | None = "cpu") -> dict:
    """Load a checkpoint after checking its magic and payload digest.

    Args:
        path: A checkpoint file written by :func:`save_checkpoint`.
        map_location: Where tensors go; CPU by default so that a checkpoint written
            on a GPU box loads anywhere (``load_state_dict`` moves them later).

    Returns:
        The saved state dict.

    Raises:
        CheckpointError: bad magic, truncation, a digest mismatch, or a payload
            that does not unpickle under ``weights_only=True``.
        OSError: the file cannot be opened or read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        expected = _read_header(f, path)
        actual = hashlib.sha256()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            actual.update(view[:n])
        if actual.digest() != expected:
            raise CheckpointError(
                f"{path}: payload digest mismatch (header {expected.hex()[:16]}, "
                f"payload {actual.hexdigest()[:16]}): file is corrupt or truncated"
            )
        # Read the verified payload through the same open file, so a concurrent
        # replace of the path cannot swap in bytes that were not checked.
        try:
            state = torch.load(
                _OffsetReader(f, HEADER_SIZE), map_location=map_location, weights_only=True
            )
        except Exception as exc:
            raise CheckpointError(f"{path}: payload does not load: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: payload is a {type(state).__name__}, not a dict")
    return state


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """Checkpoints in ``directory``, newest round first.

    Temporary files of unfinished saves are ignored. A file whose header is missing
    or wrong is skipped with a warning; the digest of the others is the one their
    header records, checked only by :func:`load_checkpoint`.

    Args:
        directory: The checkpoint directory; missing means no checkpoints.

    Returns:
        One entry per checkpoint with a well-formed header.
    """
    infos = []
    for round_, path in _checkpoint_files(Path(directory)):
        try:
            with open(path, "rb") as f:
                digest = _read_header(f, path)
        except (OSError, CheckpointError) as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
            continue
        infos.append(CheckpointInfo(path=path, round=round_, digest=digest.hex()))
    return infos


def load_latest(directory: Path) -> tuple[CheckpointInfo, dict] | None:
    """Load the newest checkpoint that verifies, falling back to older ones.

    Args:
        directory: The checkpoint directory.

    Returns:
        The checkpoint's info and its state, or ``None`` when no checkpoint in the
        directory verifies.
    """
    for info in list_checkpoints(directory):
        try:
            state = load_checkpoint(info.path)
        except (OSError, CheckpointError) as exc:
            logger.warning("checkpoint round %d unusable, trying an older one: %s", info.round, exc)
            continue
        return info, state
    return None


def _checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    """``(round, path)`` of every final-named checkpoint file, newest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME_RE.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    found.sort(key=lambda item: item[0], reverse=True)
    return found


def _prune(directory: Path, keep: int, just_written: Path) -> None:
    for _, path in _checkpoint_files(directory)[keep:]:
        if path == just_written:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            logger.debug("pruned old checkpoint %s", path)
    # A save killed mid-write leaves its temp file behind; at model scale that is
    # gigabytes the node would otherwise carry forever.
    for path in directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            logger.info("removed leftover temporary checkpoint %s", path)


def _read_header(f: io.BufferedIOBase, path: Path) -> bytes:
    """Check the magic and return the recorded payload digest."""
    header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE:
        raise CheckpointError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)")
    if header[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not an Atoll checkpoint (bad magic)")
    return header[len(MAGIC) :]


def _check_loadable(obj: Any, where: str) -> None:
    """Raise ``ValueError`` naming the first value weights-only loading would reject."""
    kind = type(obj)
    if kind in _LEAF_TYPES or kind in _TENSOR_TYPES:
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            _check_loadable(key, f"{where} key {key!r}")
            _check_loadable(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple):
        for i, value in enumerate(obj):
            _check_loadable(value, f"{where}[{i}]")
        return
    raise ValueError(
        f"checkpoint {where}: type {kind.__qualname__} cannot be loaded with "
        "torch.load(weights_only=True); convert it to tensors, numbers, strings, "
        "lists or dicts"
    )


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, f: io.BufferedIOBase) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc  # torch.save replaces it with a RuntimeError
            raise

    def flush(self) -> None:
        self._f.flush()


class _OffsetReader(io.RawIOBase):
    """A read-only view of a file from ``offset`` on, seekable as if it began there."""

    def __init__(self, f: io.BufferedIOBase, offset: int) -> None:
        super().__init__()
        self._f = f
        self._offset = offset
        f.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._f.readinto(buffer)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos += self._offset
        return self._f.seek(pos, whence) - self._offset

    def tell(self) -> int:
        return self._f.tell() - self._offset
