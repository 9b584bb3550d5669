"""A real swarm of a Hugging Face model on BPE shards: two llama-tiny nodes train, agree
bitwise, and hand back a folder transformers loads with the swarm's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.cli import main
from node.data.corpus import stdlib_files
from node.data.prepare import prepare
from node.run.metrics import read_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "shards"
    files = [str(p) for _, p in stdlib_files()[:120]]
    prepare(files, out, train_vocab=512, workers=2)
    return out


def test_two_llama_nodes_on_bpe_shards_train_agree_and_export(
    local_swarm, bpe_shards: Path, tmp_path: Path
) -> None:
    local_swarm.launch(
        2,
        rounds=3,
        extra=[
            "model.arch='hf'",
            "model.preset='llama-tiny'",
            f"data.shards={json.dumps(str(bpe_shards))}",
            "train.lr=3e-3",
        ],
    )
    assert local_swarm.wait_all(240), "swarm did not finish"
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0, 0], summary["failed_nodes"]
    assert summary["rounds_checked"] == 3 and summary["params_agree"], summary
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 0.3, summary
    node = local_swarm.nodes[0]
    rounds = read_events(node.data_dir / "events.jsonl", "round")
    assert all(r["host_bytes_per_param"] > 16 for r in rounds)  # weights, grads, AdamW at least
    syncs = read_events(node.data_dir / "events.jsonl", "sync")
    assert syncs and all(s["complete"] and len(s["group"]) == 2 for s in syncs)
    # what the swarm agreed on, as a from_pretrained folder
    out = tmp_path / "export"
    assert (
        main(["export", "--format", "hf", "--data-dir", str(node.data_dir), "--out", str(out)]) == 0
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from node.ops.handoff import global_model

    lm = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert lm.config.model_type == "llama" and lm.config.vocab_size == 512
    ours, _, source = global_model(node.data_dir)
    assert source["round"] == "3"
    batch = torch.tensor([tok("import os\nimport sys\n\ndef main():\n    return 0\n").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(lm(batch).logits, ours(batch), rtol=0, atol=1e-5)
    printed = subprocess.run(
        [sys.executable, "-m", "node.cli", "sample", "--data-dir", str(node.data_dir)]
        + ["--prompt", "def ", "--max-tokens", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("def ") and len(printed.stdout.strip()) > len("def")
