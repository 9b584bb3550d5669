"""Whole-or-nothing file writes: a node's data directory, its key file.

A file is written to a temporary sibling (same directory, hence same filesystem, so
the rename is atomic), optionally fsynced, and renamed over its final name; a durable
write then fsyncs the directory so the rename itself survives a crash. A reader sees
the previous file or the new one, never a partial file under the final name, and a
failed write leaves neither the new file nor its temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_file", "atomic_write", "fsync_dir"]

_TMP_ATTEMPTS = 100
_DEFAULT_PERMS = 0o666


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a platform that cannot (Windows) skips it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(
    path: Path,
    mode: str = "wb",
    *,
    durable: bool = True,
    perms: int = _DEFAULT_PERMS,
    prefix: str | None = None,
    suffix: str = ".tmp",
    replace: bool = True,
    encoding: str | None = None,
) -> Iterator[IO[Any]]:
    """A file open for writing whose content becomes ``path`` when the block ends.

    Args:
        path: the final file.
        mode: ``"wb"`` or ``"w"``.
        durable: fsync the file before the rename and the directory after it; a live
            view rewritten constantly (``status.json``) leaves both out.
        perms: permission bits of the new file: the default is narrowed by the umask,
            as for ``open``; any other value is set exactly (a key file's 0600 must
            stay readable by its owner under a restrictive umask).
        prefix: the temporary file's name starts with this (default ``.NAME.``); its
            suffix is ``suffix``, with random characters between.
        replace: replace an existing ``path``; False refuses one with
            ``FileExistsError`` (a hard link, which fails if ``path`` exists).
        encoding: the text encoding for mode ``"w"``.

    Raises:
        FileExistsError: ``replace`` is False and ``path`` exists.
        OSError: the write failed; one without a file name (a full disk) is raised
            again naming ``path``.
    """
    path = Path(path)
    fd, tmp = _create_temp(path, prefix if prefix is not None else f".{path.name}.", suffix, perms)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            if perms != _DEFAULT_PERMS:
                os.fchmod(f.fileno(), perms)
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno and not exc.filename:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes | str, **options: Any) -> None:
    """Write ``data`` (bytes, or text as UTF-8) as ``path`` whole or not at all.

    Args:
        path: the final file.
        data: its whole content.
        **options: as for :func:`atomic_file` (``durable``, ``perms``, ``replace``...).
    """
    text = isinstance(data, str)
    with atomic_file(
        path, "w" if text else "wb", encoding="utf-8" if text else None, **options
    ) as f:
        f.write(data)


def _create_temp(path: Path, prefix: str, suffix: str, perms: int) -> tuple[int, Path]:
    """A new, exclusively created file beside ``path``: its descriptor and path."""
    for _ in range(_TMP_ATTEMPTS):
        tmp = path.with_name(f"{prefix}{os.urandom(4).hex()}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, perms), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(path))


def _publish_new(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path`` unless ``path`` exists (a hard link fails if it does)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        # Some filesystems have no hard links: check, then rename.
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
    else:
        tmp.unlink(missing_ok=True)
