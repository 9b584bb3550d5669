"""What a run binds besides its settings: the model's config, its first weights, the
tokenizer of its data and the data itself.

A node's config names files (``model.hf_config``, ``model.init_from``,
``data.shards``, ``data.paths``) that lie at other paths on other machines; what must
be the same on every node is what is in them. :func:`bind` fills in their digests
(``model.config_digest``, ``model.init_digest``, ``data.tokenizer_digest``,
``data.dataset_digest``) and, for a preset without ``model.vocab_size``, the
tokenizer's vocabulary size; a digest the config already holds (from a run spec) must
match the files, or the node stops at start with one line naming the key. Nodes then
compare these values like any other shared setting (:func:`node.spec.settings_digest`).

The dataset digest (:func:`dataset_digest`) is what lets peers recompute the batches
a node was assigned: it covers every train and validation token. Shards are hashed
once and the per-file hashes kept in ``digest.json`` beside them, so later starts only
stat the files; a text corpus is hashed from the files it is read from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import struct
import time
from pathlib import Path
from typing import Any

from node.config import AtollConfig, ConfigError, DataConfig
from node.data.sources import BYTES_DIGEST, DataError, user_files
from verification.files import atomic_write

__all__ = ["DIGEST_CACHE", "bind", "dataset_digest"]

DIGEST_CACHE = "digest.json"
"""The file in a shards folder that keeps ``{name: [size, mtime_ns, sha256 hex]}``."""

_SHARDS_DOMAIN = b"atoll/dataset/shards/v1\0"
_TEXT_DOMAIN = b"atoll/dataset/text/v1\0"
_SHARD_FILES = ("train.bin", "val.bin")
_CHUNK = 1 << 20
# A file changed again within the filesystem's timestamp tick of being hashed keeps
# its mtime: only files this much older than their hashing are trusted to the cache
# (git's "racily clean" entries, same idea).
_SETTLE_NS = 2_000_000_000


def bind(cfg: AtollConfig) -> AtollConfig:
    """``cfg`` with the digests of the files it names filled in (see the module docstring).

    Raises:
        ConfigError: a digest ``cfg`` holds that its files do not have, or a file that
            cannot be read.
        DataError: ``data.shards`` without a readable ``meta.json`` or shard files, a
            ``data.paths`` pattern that matches nothing, or an unreadable corpus file.
    """
    model, data = cfg.model, cfg.data
    tokenizer, data_vocab = BYTES_DIGEST, None
    if data.shards:
        from node.data.corpus import read_meta

        meta = read_meta(data.shards)
        tokenizer = meta["tokenizer"]["digest"]
        if tokenizer != BYTES_DIGEST:
            data_vocab = meta.get("vocab_size")
    _check("data.tokenizer_digest", data.tokenizer_digest, tokenizer, "data.shards' tokenizer")
    dataset = dataset_digest(data)
    _check("data.dataset_digest", data.dataset_digest, dataset, _data_source(data))
    model_updates: dict[str, object] = {}
    if model.arch == "hf":
        from node.train.hf import config_digest, load_config_dict, weights_digest

        if not model.vocab_size and model.preset and data_vocab:
            model_updates["vocab_size"] = data_vocab
            model = dataclasses.replace(model, vocab_size=data_vocab)
        source = next(
            f"model.{k}" for k in ("preset", "hf_config", "init_from") if getattr(model, k)
        )
        digest = config_digest(load_config_dict(model))
        _check("model.config_digest", model.config_digest, digest, f"{source}'s config")
        model_updates["config_digest"] = digest
        if model.init_from:
            weights = weights_digest(model.init_from)
            _check("model.init_digest", model.init_digest, weights, "model.init_from's weights")
            model_updates["init_digest"] = weights
    return cfg.replace(
        model=model_updates, data={"tokenizer_digest": tokenizer, "dataset_digest": dataset}
    )


def dataset_digest(data: DataConfig) -> str:
    """Hex SHA-256 of the train and validation tokens ``data`` names.

    Shards: a domain tag and the token type, then ``train.bin`` and ``val.bin``, each as
    its name, size and the SHA-256 of its content (what ``sha256sum`` prints), the
    latter kept in ``digest.json`` while the file's size and mtime stay the same. A text
    corpus (``data.paths``, or the standard library): a domain tag and
    ``data.val_fraction``, then every file read (after ``data.max_files``), in order,
    as its path, size and content digest: the inputs the split into train and
    validation bytes is a function of.

    Raises:
        DataError: ``data.shards`` without a readable ``meta.json`` or shard files, a
            ``data.paths`` pattern that matches nothing, or an unreadable file.
    """
    if data.shards:
        from node.data.corpus import read_meta

        dtype = read_meta(data.shards)["dtype"]
        return _shards_digest(
            Path(data.shards).expanduser(), dtype, f"data.shards = {data.shards!r}"
        )
    return _text_digest(data)


def _shards_digest(root: Path, dtype: str, where: str) -> str:
    cache_path = root / DIGEST_CACHE
    cache = _read_cache(cache_path)
    fresh: dict[str, list[Any]] = {}
    outer = hashlib.sha256(_SHARDS_DOMAIN + dtype.encode() + b"\0")
    buffer = bytearray(_CHUNK)
    for name in _SHARD_FILES:
        path = root / name
        try:
            before = path.stat()
            entry = cache.get(name)
            if entry is not None and entry[:2] == [before.st_size, before.st_mtime_ns]:
                size, digest = before.st_size, entry[2]
            else:
                size, digest = _file_digest(path, buffer)
                after = path.stat()
                settled = time.time_ns() - after.st_mtime_ns >= _SETTLE_NS
                same = (before.st_size, before.st_mtime_ns) == (size, after.st_mtime_ns)
                if settled and same:
                    fresh[name] = [size, after.st_mtime_ns, digest]
        except FileNotFoundError:
            raise DataError(f"{where}: {name} is missing") from None
        except OSError as exc:
            raise DataError(f"{where}: cannot read {name} ({exc.strerror})") from None
        _add(outer, name, size, digest)
    if fresh:
        kept = {name: entry for name, entry in cache.items() if name not in fresh}
        # a read-only folder: hashed at every start; a cache lost in a crash is no loss
        with contextlib.suppress(OSError):
            text = json.dumps({**kept, **fresh}, sort_keys=True) + "\n"
            atomic_write(cache_path, text, durable=False)
    return outer.hexdigest()


def _text_digest(data: DataConfig) -> str:
    if data.paths:
        files = user_files(data.paths)
    else:
        from node.data.corpus import stdlib_files

        files = stdlib_files()
    if data.max_files:
        files = files[: data.max_files]
    outer = hashlib.sha256(_TEXT_DOMAIN + struct.pack("<d", data.val_fraction))
    buffer = bytearray(_CHUNK)
    for rel, path in files:
        try:
            size, digest = _file_digest(path, buffer)
        except OSError as exc:
            raise DataError(
                f"cannot read corpus file {path} ({exc.strerror}); fix its permissions or "
                "leave it out of data.paths"
            ) from None
        _add(outer, rel, size, digest)
    return outer.hexdigest()


def _file_digest(path: Path, buffer: bytearray) -> tuple[int, str]:
    """The size and hex SHA-256 of ``path``'s content, read in ``buffer``-sized chunks."""
    h, size, view = hashlib.sha256(), 0, memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _add(outer: Any, name: str, size: int, digest: str) -> None:
    outer.update(name.encode() + b"\0" + struct.pack("<Q", size) + bytes.fromhex(digest))


def _read_cache(path: Path) -> dict[str, list[Any]]:
    """The well-formed entries of a ``digest.json``; none if it is missing or garbled."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {name: entry for name, entry in raw.items() if name in _SHARD_FILES and _valid(entry)}


def _valid(entry: Any) -> bool:
    if not (isinstance(entry, list) and len(entry) == 3):
        return False
    size, mtime, digest = entry
    return (
        all(isinstance(v, int) and not isinstance(v, bool) for v in (size, mtime))
        and isinstance(digest, str)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


def _data_source(data: DataConfig) -> str:
    if data.shards:
        return "data.shards' data"
    return "data.paths' data" if data.paths else "the standard library corpus"


def _check(key: str, bound: str, actual: str, source: str) -> None:
    if bound and bound != actual:
        raise ConfigError(
            f"config error: {key} = {bound[:16]!r} (the run's) but {source} is "
            f"{actual[:16]!r}: use the run's files, or leave {key} unset without a run spec"
        )
