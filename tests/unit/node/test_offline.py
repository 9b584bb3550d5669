"""Loading models, tokenizers and corpora opens no connection anywhere: offline mode is
enforced, and a hub name is refused at once instead of being fetched."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from node.data.corpus import stdlib_files
from node.data.tokenizer import save_tokenizer, train_tokenizer

_SCRIPT = r"""
import json, socket, sys

seen = []


def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        seen.append([event, repr(args)[:160]])


sys.addaudithook(hook)
import node  # sets offline mode before any Hugging Face library loads
from pathlib import Path
from node.config import ModelConfig
from node.train.hf import CausalLM
from node.train.model import build_model

checkpoint, tokenizer, corpus, port = sys.argv[1:5]
model = build_model(ModelConfig(arch="hf", preset="llama-tiny", vocab_size=300, context=32))
model.lm.save_pretrained(checkpoint)
build_model(ModelConfig(arch="hf", init_from=checkpoint))
from transformers import AutoModelForCausalLM, AutoTokenizer

AutoTokenizer.from_pretrained(tokenizer)  # no local_files_only: offline mode alone
from node.data.prepare import prepare

prepare([corpus], Path(checkpoint).parent / "shards", tokenizer=tokenizer)
refused = None
try:
    AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-7b-hf")
except Exception as exc:
    refused = type(exc).__name__
quiet = list(seen)
# the hook sees connections: one to a port of this test on 127.0.0.1
socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
print(json.dumps({"quiet": quiet, "after": seen[len(quiet):], "refused": refused}))
"""


def test_models_tokenizers_and_corpora_load_without_any_connection(tmp_path: Path) -> None:
    texts = [p.read_text() for _, p in stdlib_files()[:6]]
    save_tokenizer(train_tokenizer(texts, 300), tmp_path / "tok")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        args = [str(tmp_path / "ckpt"), str(tmp_path / "tok"), str(corpus)]
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, *args, str(listener.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["quiet"] == [], report["quiet"]
    assert report["refused"] is not None  # a hub name is an error, not a download
    assert [e for e, _ in report["after"]] == ["socket.getaddrinfo", "socket.connect"]
