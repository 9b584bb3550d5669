"""The inputs of ``atoll data prepare``: what kind each file is, and its documents.

Text files hold one document each, ``.jsonl`` files one per line (a field), ``.parquet``
files one per row (a column). They are read through ``datasets`` (memory-mapped Arrow),
runs of text files in one call and every other file in a call of its own, so a broken
input stops the prepare with one line naming it (and, in a ``.jsonl`` file, the line as
an editor numbers it); ``datasets``' own log lines about it are not shown.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from node.data.sources import DataError

__all__ = ["Part", "file_kind", "read_parts", "refuse_binary", "row_place"]

_READ_BYTES = 1 << 22

Part = tuple[str, Any, str]
"""One read of the corpus: (the file or files it holds, the dataset, its text column)."""


def file_kind(path: Path) -> str:
    """``json`` (JSON lines), ``parquet`` or ``text``, by the file's name."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def read_parts(files: list[tuple[str, Path]], field: str, column: str, cache: Path) -> list[Part]:
    """Every input's documents, in path order; broken inputs stop here, each named in
    one line.

    Runs of text files are read in one ``datasets`` call (a corpus may be many small
    files); each ``.jsonl`` or ``.parquet`` file in a call of its own, so an error
    names its file.

    Args:
        files: ``(posix path, path)`` of every input (:func:`node.data.sources.user_files`).
        field: the text field of ``.jsonl`` lines.
        column: the text column of ``.parquet`` files.
        cache: the ``datasets`` cache folder.
    """
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    parts: list[Part] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            ds = _load("text", run, cache, sample_by="document")
            parts.append((run[0] if len(run) == 1 else f"{len(run)} text files", ds, "text"))
            run.clear()

    for _, path in files:
        kind = file_kind(path)
        if kind == "text":
            _check_text(path)
            run.append(str(path))
            continue
        flush()
        if path.stat().st_size == 0:
            continue  # an empty file holds no documents
        key, what, option = (
            (field, "field", "--field") if kind == "json" else (column, "column", "--column")
        )
        ds = _load(kind, [str(path)], cache)
        if key not in ds.column_names:
            raise DataError(
                f"{path}: no {key!r} {what} (it has "
                f"{', '.join(map(repr, ds.column_names)) or 'none'}); name it with {option}"
            )
        parts.append((str(path), ds.select_columns([key]), key))
    flush()
    return parts


def _check_text(path: Path) -> None:
    """A text input must be UTF-8 text: refuse binary files before reading them whole."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_READ_BYTES):
                refuse_binary(path, chunk)
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text (a byte sequence cannot be decoded)") from None
    except OSError as exc:
        raise DataError(f"cannot read corpus file {path} ({exc.strerror})") from None


def refuse_binary(path: Path, chunk: bytes) -> None:
    """A text input holds no NUL byte: one that does is refused, as bytes or documents."""
    if b"\0" in chunk:
        raise DataError(f"{path}: a binary file, not text (it holds NUL bytes)")


def row_place(where: str, row: int) -> str:
    """``line N`` of document ``row`` (from 1) of a JSON lines file, counting blank lines
    as an editor does; ``row N`` of anything else."""
    path = Path(where)
    if file_kind(path) == "json":
        with contextlib.suppress(OSError, EOFError), _open(path) as f:
            for seen, (number, line) in enumerate(_json_lines(f), 1):
                if seen == 1 and line.lstrip().startswith(b"["):
                    break  # one JSON array, not lines
                if seen == row:
                    return f"line {number}"
    return f"row {row}"


def _load(kind: str, paths: list[str], cache: Path, **kwargs: Any) -> Any:
    import datasets

    try:
        with _quiet("datasets"):  # it logs the error it raises, twice: ours is the one line
            return datasets.load_dataset(
                kind, data_files=paths, split="train", cache_dir=str(cache), **kwargs
            )
    except Exception as exc:  # datasets wraps what went wrong in its own errors
        cause = exc.__cause__ or exc
        what = {"json": "JSON lines", "parquet": "a parquet file", "text": "text"}[kind]
        where, detail = paths[0], " ".join(str(cause).split())[:200] or type(cause).__name__
        # its row numbers count from 0 in a block of 10 MB, blank lines left out: an
        # editor's line number is found here
        bad = _bad_json_line(Path(where)) if kind == "json" else None
        if bad is not None:
            where, detail = f"{where}: line {bad[0]}", bad[1]
        raise DataError(f"{where}: cannot be read as {what} ({detail})") from None


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """No log record of ``logger`` and its children while inside."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}


def _bad_json_line(path: Path) -> tuple[int, str] | None:
    """The first line of a JSON lines file that is not a JSON object, from 1, and why;
    None if there is none (or the file is one JSON array, not lines)."""
    with contextlib.suppress(OSError, EOFError), _open(path) as f:
        for seen, (number, line) in enumerate(_json_lines(f), 1):
            if seen == 1 and line.lstrip().startswith(b"["):
                return None
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                return number, f"{exc.msg} at column {exc.colno}"
            except ValueError:
                return number, "not UTF-8"
            if not isinstance(value, dict):
                return number, f"{_JSON_TYPES.get(type(value), json.dumps(value))}, not an object"
    return None


def _open(path: Path) -> IO[bytes]:
    if path.name.lower().endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return path.open("rb")


def _json_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """Each line that holds something, with its number from 1 (blank lines counted)."""
    for number, line in enumerate(f, 1):
        if line.strip():
            yield number, line
