"""Tokenizers loaded and trained offline: round trips, digests, the byte tokenizer, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.data.corpus import stdlib_files
from node.data.tokenizer import (
    EOS,
    TokenizerError,
    byte_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = [path.read_text(encoding="utf-8") for _, path in stdlib_files()[:20]]
UNICODE = "naïve café — 日本語のテキスト, emoji 🚀 and tabs\tand\r\nCRLF\x00nul"


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer(TEXTS, 600)


def test_a_trained_tokenizer_round_trips_any_text(trained) -> None:
    assert trained.vocab_size == 600 and trained.eos_token == EOS and trained.eos_id == 0
    for text in [*TEXTS[:3], UNICODE, ""]:
        assert trained.decode(trained.encode(text)) == text
    # it learned something: source text takes fewer tokens than bytes
    sample = TEXTS[0]
    assert len(trained.encode(sample)) < 0.6 * len(sample.encode())


def test_training_is_deterministic_and_the_digest_survives_saving(trained, tmp_path) -> None:
    assert train_tokenizer(TEXTS, 600).digest == trained.digest
    assert train_tokenizer(TEXTS, 700).digest != trained.digest
    save_tokenizer(trained, tmp_path / "tok")
    from_folder = load_tokenizer(tmp_path / "tok")
    from_file = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    assert from_folder.digest == from_file.digest == trained.digest
    assert from_folder.encode(UNICODE) == trained.encode(UNICODE)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert hf.eos_token == EOS and hf(UNICODE).input_ids == trained.encode(UNICODE)


def test_the_byte_tokenizer_maps_bytes_to_their_values(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    assert tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode(UNICODE) == list(UNICODE.encode("utf-8"))
    assert tok.decode(list(UNICODE.encode("utf-8"))) == UNICODE
    save_tokenizer(tok, tmp_path / "bytes")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "bytes"), local_files_only=True)
    assert hf("héllo").input_ids == list("héllo".encode())


def test_tokenizer_errors_name_the_path_and_the_fix(tmp_path: Path, trained) -> None:
    with pytest.raises(TokenizerError, match="no such file or folder"):
        load_tokenizer(tmp_path / "missing")
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        load_tokenizer(junk)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json in the folder"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(TokenizerError, match="at least 257 tokens"):
        train_tokenizer(TEXTS, 100)
    # a tokenizer without an end-of-document token needs --eos
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "bare.json"
    bare.save(str(path))
    with pytest.raises(TokenizerError, match="--eos TOKEN"):
        load_tokenizer(path)
    assert load_tokenizer(path, eos="b").eos_id == 1
    with pytest.raises(TokenizerError, match="'zz' is not in its vocabulary"):
        load_tokenizer(path, eos="zz")
