"""Token shards on disk, read through memory maps, and the slices sites and ranks take."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from node.cli import main
from node.config import DataConfig, load_config
from node.data.corpus import (
    BatchStream,
    DataError,
    load_corpus,
    load_data,
    load_shards,
    site_slice,
    slice_bounds,
)
from node.data.prepare import prepare


def _files(tmp_path: Path, n: int = 40) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"f{i:02d}.txt").write_text(f"file {i}: " + "some text to learn. " * (20 + i))
    return src


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_prepared_shards_hold_the_same_split_as_the_text_corpus(tmp_path: Path) -> None:
    src = _files(tmp_path)
    meta = prepare([str(src / "*.txt")], tmp_path / "sh", val_fraction=0.2)
    shards = load_shards(tmp_path / "sh", context=16, vocab_size=256)
    text = load_corpus(DataConfig(paths=(str(src / "*.txt"),), val_fraction=0.2), 16)
    assert torch.equal(shards.train, text.train) and torch.equal(shards.val, text.val)
    assert meta["train_tokens"] == shards.train.numel() and meta["files"] == 40
    # memory-mapped, not read: the tensor's memory lies in the file's mapping
    assert _mapped_from(shards.train, tmp_path / "sh" / "train.bin")
    assert json.loads((tmp_path / "sh" / "meta.json").read_text())["dtype"] == "uint8"


def test_a_single_file_is_split_by_its_tail(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_bytes(bytes(range(1, 256)) * 40)
    meta = prepare([str(tmp_path / "one.txt")], tmp_path / "sh", val_fraction=0.25)
    assert meta["val_tokens"] == 10200 - int(10200 * 0.75)
    shards = load_shards(tmp_path / "sh", 16, 256)
    whole = torch.cat([shards.train, shards.val])
    assert torch.equal(whole, torch.tensor(list(bytes(range(1, 256)) * 40), dtype=torch.uint8))


def _write_uint16(root: Path, train: np.ndarray, val: np.ndarray, vocab: int) -> None:
    root.mkdir()
    train.astype("<u2").tofile(root / "train.bin")
    val.astype("<u2").tofile(root / "val.bin")
    meta = {
        "format": "atoll-tokens/1",
        "dtype": "uint16",
        "vocab_size": vocab,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
    }
    (root / "meta.json").write_text(json.dumps(meta))


def test_uint16_shards_need_a_vocabulary_that_holds_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    _write_uint16(tmp_path / "sh", rng.integers(0, 1000, 500), rng.integers(0, 1000, 100), 1000)
    corpus = load_shards(tmp_path / "sh", 16, vocab_size=1000)
    assert corpus.train.dtype == torch.uint16
    inputs, targets = BatchStream(corpus.train, 4, 16, "k").next()
    assert inputs.dtype == torch.int64 and inputs.shape == (4, 16)
    with pytest.raises(DataError, match="set model.vocab_size = 1000"):
        load_shards(tmp_path / "sh", 16, vocab_size=256)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_meta", "no meta.json there"),
        ("bad_json", "cannot read meta.json"),
        ("format", "is not 'atoll-tokens/1' shards"),
        ("dtype", "dtype 'float32'"),
        ("size", "train.bin holds"),
        ("short", "fewer than one window"),
        ("missing", "val.bin is missing"),
    ],
)
def test_broken_shards_are_a_clear_error(tmp_path: Path, damage: str, message: str) -> None:
    (tmp_path / "a.txt").write_text("x" * 4000)
    root = tmp_path / "sh"
    prepare([str(tmp_path / "a.txt")], root)
    meta = json.loads((root / "meta.json").read_text())
    if damage == "no_meta":
        (root / "meta.json").unlink()
    elif damage == "bad_json":
        (root / "meta.json").write_text("{")
    elif damage in ("format", "dtype"):
        meta["format" if damage == "format" else "dtype"] = "float32"
        (root / "meta.json").write_text(json.dumps(meta))
    elif damage == "size":
        with (root / "train.bin").open("ab") as f:
            f.write(b"extra")
    elif damage == "short":
        meta["val_tokens"] = 3
        (root / "val.bin").write_bytes(b"abc")
        (root / "meta.json").write_text(json.dumps(meta))
    elif damage == "missing":
        (root / "val.bin").unlink()
    with pytest.raises(DataError, match=message):
        load_shards(root, 64, 256)


@pytest.mark.parametrize("tokens", [1000, 1001, 1024, 7919])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_slices_are_disjoint_and_cover_the_corpus(tokens: int, count: int) -> None:
    bounds = [slice_bounds(tokens, i, count) for i in range(count)]
    assert bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_each_site_and_rank_samples_only_its_own_slice() -> None:
    data = torch.arange(4000, dtype=torch.int64).to(torch.uint16)
    seen = []
    for index in range(4):  # e.g. 2 sites x 2 ranks: slice site * ranks + rank
        own = site_slice(data, index, 4, context=16)
        lo, hi = slice_bounds(4000, index, 4)
        inputs, targets = BatchStream(own, 32, 16, ("k", index)).next()
        values = torch.cat([inputs.flatten(), targets.flatten()])
        assert lo <= int(values.min()) and int(values.max()) < hi
        seen.append(set(values.tolist()))
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
    with pytest.raises(DataError, match="shorter than one window"):
        site_slice(data, 0, 1000, context=16)


def test_config_refuses_a_site_outside_the_sites_and_shards_with_paths() -> None:
    from node.config import ConfigError

    with pytest.raises(ConfigError, match="sites are numbered 0 to 1"):
        load_config(None, ["data.site=2", "data.sites=2"])
    with pytest.raises(ConfigError, match="one or the other"):
        load_config(None, ["data.shards=x", 'data.paths=["a"]'])
    with pytest.raises(DataError, match="too small for a text corpus"):
        load_data(DataConfig(), 16, vocab_size=100)


def test_atoll_data_prepare_then_a_simulated_run_trains_on_the_shards(tmp_path, capsys) -> None:
    src = _files(tmp_path, 60)
    out = tmp_path / "shards"
    assert main(["data", "prepare", str(src / "*.txt"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"--set data.shards={json.dumps(str(out))}" in said
    small = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.context=32",
        "data.batch_size=8",
        "sync.inner_steps=30",
        "train.warmup_steps=5",
        "run.threads=1",
        f"data.shards={json.dumps(str(out))}",
    ]
    assert (
        main(
            [
                "simulate",
                "--replicas",
                "2",
                "--rounds",
                "2",
                "--json",
                *[a for s in small for a in ("--set", s)],
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["val_bpb_end"] < result["val_bpb_start"]
