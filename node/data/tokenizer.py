"""Tokenizers, loaded and trained locally: a ``tokenizer.json`` or tokenizer folder, a
byte-level BPE trained on the corpus, or the byte model's 256 bytes.

A :class:`TokenizerInfo` carries the fast (Rust) tokenizer of the ``tokenizers``
library, its end-of-document token and its digest: SHA-256 of the parts of its JSON that
decide a text's ids, and its EOS token: the value ``meta.json`` records and a run spec binds, so every node
trains on tokens of the same tokenizer. :func:`save_tokenizer` writes a folder that
``AutoTokenizer.from_pretrained`` loads offline; :func:`byte_tokenizer` is the byte
model's (ids are byte values), so an exported byte model has a tokenizer too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.data.sources import BYTES_DIGEST

__all__ = [
    "BYTES_DIGEST",
    "TokenizerError",
    "TokenizerInfo",
    "byte_tokenizer",
    "load_tokenizer",
    "read_files",
    "save_tokenizer",
    "train_tokenizer",
    "write_files",
]

EOS = "<|endoftext|>"
"""The end-of-document token of a tokenizer trained by ``atoll data prepare``."""

_EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""Special tokens taken as end-of-document in a bare ``tokenizer.json``, in order."""

_MAX_FILE_BYTES = 64 * 2**20


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, trained or used; one line naming the path."""


@dataclass(frozen=True)
class TokenizerInfo:
    """A fast tokenizer and its end-of-document token.

    Attributes:
        backend: the ``tokenizers.Tokenizer``.
        eos_token: the token that ends every document (None for bytes).
        eos_id: its id.
        vocab_size: ids run from 0 to ``vocab_size - 1``.
        digest: see the module docstring.
    """

    backend: Any
    eos_token: str | None
    eos_id: int | None
    vocab_size: int
    digest: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def meta(self) -> dict[str, Any]:
        """What ``meta.json`` says of the tokenizer."""
        return {
            "digest": self.digest,
            "eos_token": self.eos_token,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
        }


_ENCODING_KEYS = ("added_tokens", "normalizer", "pre_tokenizer", "model")
"""The parts of a ``tokenizer.json`` that decide a text's ids (not its post-processor,
decoder, padding or truncation, which libraries rewrite as they save it)."""


def _info(backend: Any, eos_token: str | None, where: str) -> TokenizerInfo:
    doc = json.loads(backend.to_str())
    canonical = json.dumps(
        {k: doc.get(k) for k in _ENCODING_KEYS}, sort_keys=True, separators=(",", ":")
    )
    eos_id = None
    if eos_token is not None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"{where}: the EOS token {eos_token!r} is not in its vocabulary")
    digest = hashlib.sha256(f"{canonical}\0{eos_token}".encode()).hexdigest()
    return TokenizerInfo(backend, eos_token, eos_id, backend.get_vocab_size(), digest)


def load_tokenizer(path: str | Path, eos: str | None = None) -> TokenizerInfo:
    """A ``tokenizer.json`` file or a tokenizer folder, loaded offline (by the
    ``tokenizers`` library alone: no model hub, no ``transformers``).

    Args:
        path: the file or folder.
        eos: the end-of-document token; by default the folder's ``eos_token``
            (``tokenizer_config.json``), or the first of ``<|endoftext|>``, ``</s>``,
            ``<|end_of_text|>``, ``<eos>`` among its special tokens.

    Raises:
        TokenizerError: a missing path, a file that is not a tokenizer, a slow-only
            tokenizer (no ``tokenizer.json``), or no EOS token.
    """
    from tokenizers import Tokenizer

    root = Path(path).expanduser()
    where = f"tokenizer {root}"
    file = root
    if root.is_dir():
        file = root / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"{where}: no tokenizer.json in the folder (a fast tokenizer is needed; "
                "save it with a recent transformers, which writes tokenizer.json)"
            )
        eos = eos or _config_eos(root / "tokenizer_config.json", where)
    elif not root.exists():
        raise TokenizerError(f"{where}: no such file or folder")
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise TokenizerError(f"{where}: not a tokenizer.json ({str(exc)[:120]})") from None
    return _info(backend, eos or _find_eos(backend, where), where)


def _config_eos(path: Path, where: str) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` (a string or an added-token dict)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"{where}: cannot read tokenizer_config.json ({exc})") from None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _find_eos(backend: Any, where: str) -> str:
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    for name in _EOS_NAMES:
        if name in special:
            return name
    raise TokenizerError(
        f"{where}: no end-of-document token found among its special tokens; name it "
        "with --eos TOKEN"
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> TokenizerInfo:
    """Train a byte-level BPE (GPT-2's pre-tokenizer, every byte in its alphabet, so no
    text is unknown) of ``vocab_size`` tokens, ``<|endoftext|>`` first.

    Raises:
        TokenizerError: a vocabulary too small for the 256 bytes and the EOS token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 tokens (256 "
            "bytes and the end-of-document token)"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return _info(backend, EOS, "trained tokenizer")


def byte_tokenizer() -> TokenizerInfo:
    """The byte model's tokenizer: token ``b`` is byte ``b`` of the UTF-8 text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = pre_tokenizers.ByteLevel.alphabet()
    vocab = {_byte_char(b): b for b in range(256)}
    assert set(vocab) == set(table)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _info(backend, None, "byte tokenizer")


def _byte_char(b: int) -> str:
    """GPT-2's printable character for byte ``b`` (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def save_tokenizer(tok: TokenizerInfo, folder: Path, source: str | Path | None = None) -> None:
    """Write ``tok`` as a folder ``AutoTokenizer.from_pretrained`` loads offline:
    ``tokenizer.json`` and a ``tokenizer_config.json`` naming the EOS token (the source
    folder's, if ``tok`` came from one, with the rest of its settings kept).

    Raises:
        TokenizerError: a source ``tokenizer_config.json`` that cannot be read.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {}
    given = Path(source).expanduser() / "tokenizer_config.json" if source else None
    if given is not None and given.is_file():
        try:
            config = json.loads(given.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"tokenizer {source}: bad tokenizer_config.json ({exc})") from None
        special = Path(source).expanduser() / "special_tokens_map.json"
        if special.is_file():
            shutil.copyfile(special, folder / special.name)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if tok.eos_token is not None:
        config["eos_token"] = tok.eos_token
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def read_files(folder: Path) -> dict[str, str]:
    """A tokenizer folder's files as text, to carry in a checkpoint.

    Raises:
        TokenizerError: a file too large or not text.
    """
    files: dict[str, str] = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.stat().st_size > _MAX_FILE_BYTES:
            raise TokenizerError(f"tokenizer file {path} is over 64 MiB")
        try:
            files[path.name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"tokenizer file {path} is not text") from None
    if "tokenizer.json" not in files:
        raise TokenizerError(f"tokenizer folder {folder} has no tokenizer.json")
    return files


def write_files(files: dict[str, str], folder: Path) -> None:
    """Write a tokenizer folder carried by :func:`read_files`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if Path(name).name != name:
            raise TokenizerError(f"tokenizer file name {name!r} is not a plain file name")
        (folder / name).write_text(text, encoding="utf-8")
