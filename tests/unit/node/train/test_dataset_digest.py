"""The dataset digest: every node of a run holds the same train and validation tokens,
hashed once per shards folder and then known from ``digest.json`` by the files' sizes
and mtimes; a node on other data stops at start, naming the key."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import node.train.bindings
from node.cli import main
from node.config import ConfigError, load_config
from node.data.corpus import DataError, stdlib_files
from node.data.prepare import prepare
from node.data.sources import SHARDS_FORMAT
from node.shared_settings import settings_digest, shared_settings
from node.train.bindings import DIGEST_CACHE, bind, dataset_digest

BOOT = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
TRAIN = bytes(range(256)) * 40
VAL = bytes(range(255, -1, -1)) * 8


def _shards(root: Path, train: bytes = TRAIN, val: bytes = VAL, dtype: str = "uint8") -> Path:
    """A shards folder as ``atoll data prepare`` lays it out, of byte tokens."""
    root.mkdir(parents=True)
    width = 2 if dtype == "uint16" else 1
    meta = {
        "format": SHARDS_FORMAT,
        "dtype": dtype,
        "vocab_size": 256,
        "train_tokens": len(train) // width,
        "val_tokens": len(val) // width,
        "tokenizer": {"digest": "bytes"},
        "bytes_per_token": 1.0,
    }
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "train.bin").write_bytes(train)
    (root / "val.bin").write_bytes(val)
    return root


def _age(root: Path, seconds: float = 60.0) -> None:
    """Date the shard files back, as on any start but the one right after writing them."""
    for name in ("train.bin", "val.bin"):
        then = (root / name).stat().st_mtime_ns - int(seconds * 1e9)
        os.utime(root / name, ns=(then, then))


def _flip(path: Path, at: int = 100) -> None:
    """Change one byte of ``path`` in place (same size)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _digest(root: Path) -> str:
    return dataset_digest(load_config(None, [f"data.shards={json.dumps(str(root))}"]).data)


def _cfg(root: Path):
    return load_config(None, [f"data.shards={json.dumps(str(root))}"])


# ---- shards -------------------------------------------------------------------------------


def test_the_same_tokens_give_the_same_digest_and_one_byte_another(tmp_path: Path) -> None:
    a, b = _shards(tmp_path / "a"), _shards(tmp_path / "b")
    assert _digest(a) == _digest(b)  # the path is each node's own: only the tokens count
    assert len(_digest(a)) == 64
    for name in ("train.bin", "val.bin"):
        other = _shards(tmp_path / f"other-{name}")
        _flip(other / name)
        assert _digest(other) != _digest(a), name
    # the same bytes read as other tokens are other data
    wide = _shards(tmp_path / "wide", dtype="uint16")
    assert _digest(wide) != _digest(a)


def test_prepared_shards_of_the_same_text_bind_to_the_same_digest(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, (_, path) in enumerate(stdlib_files()[:6]):
        (docs / f"d{i}.txt").write_bytes(path.read_bytes())
    for name in ("one", "two"):
        prepare([str(docs / "*.txt")], tmp_path / name)
    one, two = bind(_cfg(tmp_path / "one")), bind(_cfg(tmp_path / "two"))
    assert one.data.dataset_digest == two.data.dataset_digest
    assert bind(one) == one  # bound again: the same
    # nodes without a spec on other data do not see each other
    _flip(tmp_path / "two" / "train.bin")
    assert settings_digest(bind(_cfg(tmp_path / "two"))) != settings_digest(one)


def test_the_cache_spares_reading_the_files_until_they_change(tmp_path: Path, monkeypatch) -> None:
    root = _shards(tmp_path / "s")
    _age(root)
    first = _digest(root)
    cache = json.loads((root / DIGEST_CACHE).read_text())
    for name in ("train.bin", "val.bin"):
        stat = (root / name).stat()
        content = hashlib.sha256((root / name).read_bytes()).hexdigest()  # as sha256sum
        assert cache[name] == [stat.st_size, stat.st_mtime_ns, content]
    opened: list[object] = []
    real_open = open
    monkeypatch.setattr(
        node.train.bindings, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k),
        raising=False,
    )  # fmt: skip
    assert _digest(root) == first
    assert opened == []  # known by size and mtime: not read
    # a change that keeps size and mtime is not seen: the cache is trusted on them
    then = (root / "train.bin").stat().st_mtime_ns
    _flip(root / "train.bin")
    os.utime(root / "train.bin", ns=(then, then))
    assert _digest(root) == first and opened == []
    # a new mtime: read again, and the digest is the changed tokens'
    os.utime(root / "train.bin", ns=(then + 1, then + 1))
    changed = _digest(root)
    assert opened == [root / "train.bin"]
    assert changed != first
    fresh = _shards(tmp_path / "fresh", train=(root / "train.bin").read_bytes())
    assert changed == _digest(fresh)
    assert json.loads((root / DIGEST_CACHE).read_text())["train.bin"][1] == then + 1


def test_files_just_written_are_hashed_but_not_cached(tmp_path: Path) -> None:
    root = _shards(tmp_path / "s")
    first = _digest(root)
    # a write within the same timestamp tick would keep the mtime: not trusted yet
    assert not (root / DIGEST_CACHE).exists()
    _age(root)
    assert _digest(root) == first
    assert (root / DIGEST_CACHE).exists()


def test_an_unwritable_or_garbled_cache_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    root = _shards(tmp_path / "s")
    _age(root)
    plain = _digest(_shards(tmp_path / "plain"))

    def read_only(path: Path, *args, **kwargs) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    with monkeypatch.context() as m:
        m.setattr(node.train.bindings, "atomic_write", read_only)
        assert _digest(root) == plain
    assert not (root / DIGEST_CACHE).exists()
    for garbage in ("{not json", "[1, 2]", json.dumps({"train.bin": [1, 2, "zz"]})):
        (root / DIGEST_CACHE).write_text(garbage)
        assert _digest(root) == plain
        assert len(json.loads((root / DIGEST_CACHE).read_text())) == 2  # written anew
    # an entry of another file's digest under the right size and mtime is believed: the
    # cache is this node's own, like the files
    stat = (root / "val.bin").stat()
    (root / DIGEST_CACHE).write_text(
        json.dumps({"val.bin": [stat.st_size, stat.st_mtime_ns, "0" * 64]})
    )
    assert _digest(root) != plain


def test_a_missing_shard_file_is_named(tmp_path: Path) -> None:
    root = _shards(tmp_path / "s")
    (root / "val.bin").unlink()
    with pytest.raises(DataError, match=r"data.shards = .*: val.bin is missing"):
        _digest(root)


# ---- text corpora -------------------------------------------------------------------------


def test_a_text_corpus_is_bound_by_its_files_and_split(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"t{i}.txt").write_bytes(bytes([65 + i]) * 3000)
    paths = f"data.paths=[{str(tmp_path / '*.txt')!r}]"
    base = load_config(None, [paths]).data
    assert dataset_digest(base) == dataset_digest(load_config(None, [paths]).data)
    # another split, fewer files or one byte changed are other train and validation bytes
    other_split = load_config(None, [paths, "data.val_fraction=0.3"]).data
    fewer = load_config(None, [paths, "data.max_files=3"]).data
    assert len({dataset_digest(c) for c in (base, other_split, fewer)}) == 3
    before = dataset_digest(base)
    _flip(tmp_path / "t2.txt")
    assert dataset_digest(base) != before
    bound = bind(load_config(None, [paths]))
    assert bound.data.dataset_digest == dataset_digest(base)


def test_the_standard_library_corpus_is_bound_too() -> None:
    small = load_config(None, ["data.max_files=20"])
    bound = bind(small)
    assert len(bound.data.dataset_digest) == 64
    assert (
        bound.data.dataset_digest != bind(small.replace(data={"max_files": 21})).data.dataset_digest
    )


# ---- the run's value ----------------------------------------------------------------------


def test_a_dataset_digest_the_data_does_not_have_is_refused(tmp_path: Path) -> None:
    bound = bind(_cfg(_shards(tmp_path / "a")))
    assert bind(bound) == bound
    wrong = bound.replace(data={"dataset_digest": "f" * 64})
    with pytest.raises(
        ConfigError,
        match=r"^config error: data.dataset_digest = 'ffffffffffffffff' \(the run's\) but "
        r"data.shards' data is '[0-9a-f]{16}': use the run's files",
    ):
        bind(wrong)
    text = bind(load_config(None, ["data.max_files=5"]))
    with pytest.raises(ConfigError, match=r"but the standard library corpus is '"):
        bind(text.replace(data={"dataset_digest": "f" * 64}))


def test_the_shared_settings_carry_the_dataset_digest(tmp_path: Path) -> None:
    a = bind(_cfg(_shards(tmp_path / "a")))
    assert shared_settings(a)["data"]["dataset_digest"] == a.data.dataset_digest
    b = a.replace(data={"dataset_digest": "0" * 64})
    assert settings_digest(a) != settings_digest(b)
    # the same tokens elsewhere: the same shared settings
    moved = bind(_cfg(_shards(tmp_path / "b")))
    assert settings_digest(moved) == settings_digest(a)


def test_a_node_on_other_data_than_the_specs_stops_at_start(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    import node.daemon

    run_shards = _shards(tmp_path / "run")
    other = tmp_path / "other"
    shutil.copytree(run_shards, other)
    _flip(other / "train.bin")
    config = tmp_path / "creator.toml"
    config.write_text(f'[run]\nrun_id = "data"\n[data]\nshards = {json.dumps(str(run_shards))}\n')
    spec = tmp_path / "run.toml"
    made = main(
        ["spec", "create", "--config", str(config), "--data-dir", str(tmp_path / "creator"),
         "--bootstrap", BOOT, "--t0", "2000000000", "--out", str(spec)]
    )  # fmt: skip
    assert made == 0
    capsys.readouterr()
    started: list = []
    monkeypatch.setattr(node.daemon.Node, "run", lambda self: started.append(self.cfg) or 0)
    for shards, code in ((other, 2), (run_shards, 0)):
        local = tmp_path / "volunteer.toml"
        local.write_text(f"[data]\nshards = {json.dumps(str(shards))}\n")
        args = ["run", "--spec", str(spec), "--config", str(local)]
        assert main([*args, "--data-dir", str(tmp_path / "v")]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("atoll: config error: data.dataset_digest = ") and "\n" not in err
    assert len(started) == 1
    assert started[0].data.dataset_digest == bind(_cfg(run_shards)).data.dataset_digest
