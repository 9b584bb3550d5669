import math

import pytest
import torch

from node.config import DataConfig
from node.data.corpus import BatchStream, DataError, bits_per_byte, load_corpus, stdlib_files


def test_stdlib_corpus_found_sorted_without_site_packages():
    files = stdlib_files()
    rels = [r for r, _ in files]
    assert len(rels) > 500
    assert rels == sorted(rels)
    assert "os.py" in rels
    assert not any("site-packages" in r for r in rels)


def test_split_by_file_is_deterministic():
    cfg = DataConfig(max_files=200)
    a = load_corpus(cfg, 64)
    b = load_corpus(cfg, 64)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.files == 200
    frac = a.val.numel() / (a.val.numel() + a.train.numel())
    assert 0.01 < frac < 0.4


def test_user_paths_and_globs(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 50)
    corpus = load_corpus(DataConfig(paths=(str(tmp_path / "*.txt"),)), 16)
    assert corpus.files == 30
    assert corpus.train.numel() + corpus.val.numel() == sum(
        len(f"file {i} " * 50) for i in range(30)
    )


def test_single_file_splits_bytes(tmp_path):
    (tmp_path / "one.txt").write_bytes(bytes(range(256)) * 10)
    corpus = load_corpus(DataConfig(paths=(str(tmp_path / "one.txt"),), val_fraction=0.25), 16)
    assert corpus.val.numel() == 640 and corpus.train.numel() == 1920


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="matches no readable file"):
        load_corpus(DataConfig(paths=(str(tmp_path / "*.nothing"),)), 16)
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(DataError, match="fewer than one window"):
        load_corpus(DataConfig(paths=(str(tmp_path / "small.txt"),)), 16)


def test_batches_deterministic_per_key_and_shifted():
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    a = BatchStream(data, 4, 16, ("seed", 0))
    b = BatchStream(data, 4, 16, ("seed", 0))
    c = BatchStream(data, 4, 16, ("seed", 1))
    xa, ya = a.next()
    xb, _ = b.next()
    xc, _ = c.next()
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    assert xa.shape == (4, 16) and xa.dtype == torch.int64
    torch.testing.assert_close(xa[:, 1:], ya[:, :-1])
    fixed1 = a.fixed_batches(2)
    fixed2 = a.fixed_batches(2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(fixed1, fixed2))


def test_bits_per_byte():
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)
