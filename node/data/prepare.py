"""``atoll data prepare``: a corpus of documents into token shards a node memory-maps.

Two ways in:

* **Bytes** (no tokenizer, text files only): every file is copied as it is, split into
  train and validation by a hash of its path, as ``data.paths`` reads them
  (:func:`prepare_bytes`, :mod:`node.data.prepare_shards`).
* **Documents** (:func:`prepare_documents`): text files (one document each), ``.jsonl``
  (one per line, ``--field``) and ``.parquet`` (one per row, ``--column``), read from
  local files through ``datasets`` (:mod:`node.data.prepare_inputs`), in path order and then
  row order. Each document is tokenized with the given tokenizer (``--tokenizer``) or
  one trained on the corpus (``--train-tokenizer``, saved in ``DIR/tokenizer``), ends
  with the tokenizer's EOS token, and goes to train or validation by a hash of its text
  (so a document and its exact copies always land on the same side). Tokens are
  ``uint16`` up to 65,536 tokens, else ``uint32``.

Documents are tokenized in pieces of about ``piece_mb`` MiB of text by worker processes,
at most 256 KiB of text at a time (a longer document in parts cut at a space between
words), so memory follows the piece, not the longest document; each finished piece is
written to ``DIR/.prepare/`` with its counts and a digest of its documents, and only
when all are done are they joined into ``train.bin`` and ``val.bin`` and ``meta.json``
written (last, atomically). An interrupted prepare therefore resumes where it stopped
when the same command runs again; if its inputs changed since, it starts over by itself,
keeping the pieces whose documents are the same; a command of other settings is refused,
saying how to start over. ``meta.json`` records the tokenizer's digest and the text's
bytes per validation token, so validation bits per byte compare across tokenizers.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.data.prepare_inputs import Part, file_kind, read_parts, row_place
from node.data.prepare_shards import join_pieces, prepare_bytes
from node.data.prepare_tokens import WorkerSetup as _WorkerSetup
from node.data.prepare_tokens import clear_worker, init_pool_worker, load_worker
from node.data.prepare_tokens import digest_texts as _digest
from node.data.prepare_tokens import tokenize_piece as _tokenize_piece
from node.data.sources import BYTES_DIGEST, DataError, is_val, user_files
from verification.files import atomic_write

__all__ = ["Interrupted", "prepare", "prepare_bytes", "prepare_documents"]

log = logging.getLogger(__name__)

_WORK = ".prepare"
_JOB_VERSION = 1
_TOKENIZER_TEXT_BYTES = 1 << 30
"""A tokenizer is trained on at most this much of the train split's text."""

Progress = Callable[[int, int], None]
"""Called with (documents done, documents in all) as pieces finish."""


class Interrupted(Exception):
    """A prepare stopped by Ctrl-C or SIGTERM; what was finished is kept."""


def prepare(
    patterns: Sequence[str],
    out: Path,
    *,
    tokenizer: str | None = None,
    train_vocab: int | None = None,
    field: str = "text",
    column: str = "text",
    eos: str | None = None,
    val_fraction: float = 0.1,
    workers: int = 1,
    piece_mb: float = 16.0,
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the corpus ``patterns`` name as shards in ``out``; returns ``meta.json``.

    Bytes when no tokenizer is named and every input is a text file, else documents.

    Raises:
        DataError: bad inputs, options or an unfinished prepare of another job, in one
            line naming the file or option.
        Interrupted: stopped by a signal (run the same command again to resume).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: expected a number between 0 and 1")
    if tokenizer and train_vocab:
        raise DataError("--tokenizer and --train-tokenizer: use one or the other")
    files = user_files(tuple(patterns), key="atoll data prepare")
    _claim(out, force)
    if not tokenizer and not train_vocab and all(file_kind(p) == "text" for _, p in files):
        return prepare_bytes(files, out, val_fraction)
    return prepare_documents(
        files,
        out,
        _Job(
            tokenizer=tokenizer,
            train_vocab=train_vocab,
            field=field,
            column=column,
            eos=eos,
            val_fraction=val_fraction,
            piece_bytes=max(1, int(piece_mb * 2**20)),
        ),
        workers=workers,
        progress=progress,
    )


def _claim(out: Path, force: bool) -> None:
    """``out`` is ours to write: new, an unfinished prepare, or ``force``."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; choose a folder")
    if (out / "meta.json").exists() and not force:
        raise DataError(
            f"--out {out} already holds shards (meta.json); choose another folder or "
            "pass --force to replace them"
        )
    if force:  # start over: finished shards and unfinished work alike
        for name in ("meta.json", "train.bin", "val.bin"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        shutil.rmtree(out / _WORK, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


# ---- documents ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    tokenizer: str | None
    train_vocab: int | None
    field: str
    column: str
    eos: str | None
    val_fraction: float
    piece_bytes: int


def prepare_documents(
    files: list[tuple[str, Path]],
    out: Path,
    job: _Job,
    workers: int = 1,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The documents pipeline (see the module docstring); returns ``meta.json``."""
    from node.data.tokenizer import load_tokenizer

    work = out / _WORK
    given = load_tokenizer(job.tokenizer, job.eos) if job.tokenizer else None
    _resume_or_start(work, _identity(files, job, given.digest if given else None))
    docs = _documents(files, job, work / "cache")
    tok = _tokenizer(job, given, docs, out, work)
    dtype = "uint16" if tok.vocab_size <= 65536 else "uint32"
    setup = _WorkerSetup(
        tokenizer_json=str(out / "tokenizer" / "tokenizer.json") if tok.eos_id is not None else "",
        eos_id=tok.eos_id,
        val_fraction=job.val_fraction,
        dtype=dtype,
        folder=str(work),
        piece_bytes=job.piece_bytes,
    )
    counts = _tokenize_all(docs, job.piece_bytes, setup, workers, progress)
    documents = {k: sum(c[k] for c in counts) for k in ("train_docs", "val_docs", "empty")}
    if not documents["train_docs"] + documents["val_docs"]:
        raise DataError(f"the inputs hold only empty documents ({documents['empty']})")
    meta = join_pieces(out, work, counts, dtype, job.val_fraction)
    meta.update(
        vocab_size=tok.vocab_size,
        files=len(files),
        documents=documents,
        tokenizer={**tok.meta(), "folder": "tokenizer" if tok.eos_id is not None else None},
    )
    _write_json(out / "meta.json", meta, durable=True)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _identity(files: list[tuple[str, Path]], job: _Job, tokenizer: str | None) -> dict[str, Any]:
    """What makes two prepares the same job: the inputs as they are now, and the settings."""
    inputs = []
    for rel, path in files:
        st = path.stat()
        inputs.append([rel, st.st_size, st.st_mtime_ns])
    return {
        "version": _JOB_VERSION,
        "inputs": inputs,
        "field": job.field,
        "column": job.column,
        "tokenizer": tokenizer,
        "train_vocab": job.train_vocab,
        "val_fraction": job.val_fraction,
        "piece_bytes": job.piece_bytes,
    }


def _resume_or_start(work: Path, identity: dict[str, Any]) -> None:
    """Resume the unfinished prepare in ``work`` if it is this job, or start over if only
    its inputs changed since (a fixed input, say): every finished piece is checked
    against a digest of its documents (:func:`_done`), so those that did not change are
    kept, unless a tokenizer trained on the old inputs made them all stale."""
    path = work / "job.json"
    if path.exists():
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            found = None
        if found == identity:
            return
        if not isinstance(found, dict) or _settings(found) != _settings(identity):
            raise DataError(
                f"{work} holds an unfinished prepare of other settings: run that command "
                "again to finish it, or pass --force to start this one"
            )
        old, new = ({tuple(i) for i in job.get("inputs", [])} for job in (found, identity))
        changed = sorted({rel for rel, *_ in old ^ new})
        named = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if changed[3:] else "")
        kept = "keeping the finished pieces whose documents did not change"
        if identity["train_vocab"]:
            kept = "training the tokenizer again"
            for piece in work.glob("piece-*"):
                piece.unlink()
            (work / "trained.json").unlink(missing_ok=True)
        shutil.rmtree(work / "cache", ignore_errors=True)
        log.info(
            "%s: inputs changed since its unfinished prepare (%s): starting over, %s",
            work,
            named,
            kept,
        )
    work.mkdir(parents=True, exist_ok=True)
    _write_json(path, identity)


def _settings(identity: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in identity.items() if k != "inputs"}


class _Documents:
    """The corpus's documents, in order, read through ``datasets`` (memory-mapped Arrow)."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts  # (file or files, dataset, its text column)
        self.count = sum(len(ds) for _, ds, _ in parts)

    def __iter__(self) -> Iterator[str]:
        for where, ds, key in self.parts:
            row = 0
            for batch in ds.iter(batch_size=1024):
                for text in batch[key]:
                    if not isinstance(text, str):
                        raise DataError(
                            f"{where}: {row_place(where, row + 1)}: {key!r} is "
                            f"{type(text).__name__}, not text"
                        )
                    row += 1
                    yield text


def _documents(files: list[tuple[str, Path]], job: _Job, cache: Path) -> _Documents:
    """Every input's documents (:func:`node.data.prepare_inputs.read_parts`)."""
    docs = _Documents(read_parts(files, job.field, job.column, cache))
    if docs.count == 0:
        raise DataError("the inputs hold no documents")
    return docs


def _tokenizer(job: _Job, given: Any, docs: _Documents, out: Path, work: Path) -> Any:
    """The tokenizer of the job, saved in ``out/tokenizer`` (bytes: none saved)."""
    from node.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    folder = out / "tokenizer"
    if given is not None:
        tok = given
    elif job.train_vocab:
        trained = work / "trained.json"
        if (folder / "tokenizer.json").exists() and trained.exists():
            return load_tokenizer(folder)  # trained before the interruption
        tok = train_tokenizer(_train_texts(docs, job.val_fraction), job.train_vocab)
    else:
        return _BytesTokenizer()
    shutil.rmtree(folder, ignore_errors=True)
    source = job.tokenizer if given is not None and Path(job.tokenizer).is_dir() else None
    save_tokenizer(tok, folder, source)
    _write_json(work / "trained.json", {"digest": tok.digest})
    return tok


def _train_texts(docs: _Documents, val_fraction: float) -> Iterator[str]:
    seen = 0
    for text in docs:
        if text and not is_val(text, val_fraction):
            yield text
            seen += len(text)
            if seen >= _TOKENIZER_TEXT_BYTES:
                return


class _BytesTokenizer:
    """Documents as UTF-8 bytes, no EOS: tokens for the byte model."""

    vocab_size = 256
    eos_id = None

    def meta(self) -> dict[str, Any]:
        return {"digest": BYTES_DIGEST, "eos_token": None, "eos_id": None, "vocab_size": 256}


def _pieces(docs: _Documents, piece_bytes: int) -> Iterator[tuple[int, list[str]]]:
    index, batch, size = 0, [], 0
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= piece_bytes:
            yield index, batch
            index, batch, size = index + 1, [], 0
    if batch:
        yield index, batch


def _done(folder: Path, index: int, texts: list[str]) -> dict[str, Any] | None:
    """Piece ``index``'s counts if it was finished from these very ``texts``."""
    try:
        counts = json.loads((folder / f"piece-{index:06d}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(counts, dict) or counts.get("index") != index:
        return None
    return counts if counts.get("digest") == _digest(texts) else None


def _tokenize_all(
    docs: _Documents,
    piece_bytes: int,
    setup: _WorkerSetup,
    workers: int,
    progress: Progress | None,
) -> list[dict[str, Any]]:
    """Every piece's counts, in order: finished pieces read back, the rest tokenized,
    by ``workers`` processes with at most two pieces each in flight (bounded memory)."""
    from collections import deque

    folder = Path(setup.folder)
    counts: dict[int, dict[str, Any]] = {}
    done_docs = 0

    def finished(c: dict[str, Any], n: int) -> None:
        nonlocal done_docs
        counts[c["index"]] = c
        done_docs += n
        if progress:
            progress(done_docs, docs.count)

    pool = None
    inflight: deque[tuple[Any, int]] = deque()
    try:
        if workers <= 1:
            load_worker(setup)
        for index, texts in _pieces(docs, piece_bytes):
            found = _done(folder, index, texts)
            if found is not None:
                finished(found, len(texts))
            elif workers <= 1:
                finished(_tokenize_piece(index, texts), len(texts))
            else:
                if pool is None:
                    pool = multiprocessing.get_context("spawn").Pool(
                        workers, initializer=init_pool_worker, initargs=(setup,)
                    )
                inflight.append((pool.apply_async(_tokenize_piece, (index, texts)), len(texts)))
                while len(inflight) >= 2 * workers:
                    result, n = inflight.popleft()
                    finished(result.get(), n)
        while inflight:
            result, n = inflight.popleft()
            finished(result.get(), n)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted with {len(counts)} pieces of text tokenized; run the same command "
            "again to resume"
        ) from None
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        clear_worker()
    return [counts[i] for i in sorted(counts)]


def _write_json(path: Path, value: Any, durable: bool = False) -> None:
    """Write whole or not at all (a temporary file renamed); ``durable``: on disk too."""
    atomic_write(path, json.dumps(value, indent=2) + "\n", durable=durable)
