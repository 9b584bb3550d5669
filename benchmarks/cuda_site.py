"""CUDA check: a site of 2 ranks on the GPU in bf16 trains with a CPU node.

The one prepared check for a machine with a GPU: ``atoll swarm``'s machinery starts
node 0 as a site of two ranks (``run.device = "cuda"``, ``train.precision = "bf16"``;
NCCL when each rank has a GPU of its own, gloo when they share one) and node 1 as a
one-process CPU node, for a few rounds of the quick workload. It records each node's
tokens per second, bits per byte, and whether the swarm and the site's ranks agree.
Without CUDA it reports ``skipped`` and writes nothing.

``python -m benchmarks cuda_site [--quick]`` writes ``cuda_site.json`` (``--smoke``: 1
round of 2 inner steps).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import tempfile
import time
from typing import Any

import torch

from benchmarks._common import machine_info
from benchmarks._mode import Mode
from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD

__all__ = ["run"]

_OVERRIDES = [
    "run.run_id='bench-cuda-site'",
    *QUICK_WORKLOAD,
    "sync.trigger='steps'",
    "sync.inner_steps=20",
    "sync.fragments=2",
    "sync.codec='int8'",
    "outer.momentum=0.5",
    "network.matchmaking_seconds=6",
    "network.round_timeout=10",
    "network.request_timeout=10",
]


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Node 0: 2 ranks on CUDA in bf16; node 1: the CPU. Returns what ``cuda_site.json``
    holds: per node its device, precision, ranks, tokens per second and bits per byte
    (``smoke``: 1 round of 2 inner steps, a check that it runs)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    rounds = 1 if mode.smoke else 3 if mode.quick else 8
    overrides = [*_OVERRIDES, *(["sync.inner_steps=2"] if mode.smoke else [])]
    gpu = ["--nproc-per-node", "2", "--set", "run.device='cuda'", "--set", "train.precision='bf16'"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-cuda-site-") as tmp:
        spec = swarm.SwarmSpec(
            nodes=2,
            config_paths=[],
            overrides=overrides,
            directory=pathlib.Path(tmp),
            rounds=rounds,
            extra_args={0: gpu, 1: ["--set", "run.device='cpu'"]},
        )
        nodes, finished = swarm.run_to_end(spec, timeout=240.0 + 30.0 * rounds)
        summary = swarm.summarize(nodes, load_config(None, overrides))
        per_node: list[dict[str, Any]] = []
        for n, setup in zip(nodes, ("cuda bf16, 2 ranks", "cpu fp32, 1 process")):
            status = n.status
            per_node.append(
                {
                    "setup": setup,
                    "ranks": status.get("ranks", 1),
                    "tokens_per_second": round(
                        status.get("tokens", 0) / max(1e-9, status.get("busy_seconds", 0.0)), 1
                    ),
                    "tokens": status.get("tokens"),
                    "steps": status.get("step"),
                    "val_bpb": status.get("val_bpb"),
                    "exit_code": n.proc.returncode,
                }
            )
    report = {
        "benchmark": "cuda_site",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "rounds": summary["rounds"],
        "finished": finished,
        "params_agree": summary["params_agree"],
        "ranks_agree": summary["ranks_agree"],
        "val_bpb_start": summary["val_bpb_start"],
        "val_bpb_end": summary["val_bpb_end"],
        "nodes": per_node,
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "seconds": round(time.monotonic() - started, 1),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cuda_site.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
