"""Taking the trained model out of the swarm: ``atoll export``.

A node's checkpoint holds two models: its local copy (mid-round, its own inner steps)
and the global parameters every node agreed on at the end of the checkpoint's round
(the outer optimizer's global copies, one flat vector per fragment). Export writes the
global parameters, under the model's own parameter names and shapes, to a
`safetensors <https://github.com/huggingface/safetensors>`_ file, with the round, the
run id, the fragment plan's digest and the digest of the round's global state that
peers attested in its metadata, and the SHA-256 of the exported tensors
(:func:`parameters_digest`); tensors outside the fragment plan (buffers) are the node's
own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from node.train.checkpoint import CheckpointInfo, list_checkpoints, load_checkpoint, load_latest
from protocol.averaging.fragments import Fragment, FragmentPlan, plan_fragments

__all__ = [
    "FORMAT",
    "checkpoint_metadata",
    "export_model",
    "global_tensors",
    "load_state",
    "parameters_digest",
]

FORMAT = "atoll-global-v1"


def _plan(state: dict[str, Any]) -> FragmentPlan:
    """The checkpoint's fragment plan, checked against the digest it was saved with."""
    layout = state.get("layout")
    count = len(state["outer"]["globals"])
    if layout is not None:
        plan = FragmentPlan(
            fragments=tuple(
                Fragment(index=f, names=tuple(names), shapes=tuple(tuple(s) for s in shapes))
                for f, (names, shapes) in enumerate(layout)
            )
        )
    else:  # written before checkpoints named their layout: plan it as the node did
        named = [(n, t.shape) for n, t in state["model"].items() if t.is_floating_point()]
        plan = plan_fragments(named, count)
    if plan.digest() != state.get("plan") or len(plan) != count:
        raise ValueError(
            "the checkpoint's parameters do not match its fragment plan; it was written by "
            "another model or version"
        )
    return plan


def parameters_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: each name, its dtype and shape, its bytes.
    Anyone can recompute it from the exported file (:func:`safetensors.torch.load_file`)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def load_state(data_dir: Path, round_: int | None = None) -> tuple[CheckpointInfo, dict[str, Any]]:
    """The newest valid checkpoint of a node's data directory (or that of ``round_``).

    Raises:
        ValueError: no checkpoint (of that round).
        CheckpointError: the checkpoint of ``round_`` is damaged.
    """
    folder = Path(data_dir) / "checkpoints"
    if round_ is None:
        found = load_latest(folder)
        if found is None:
            raise ValueError(f"no valid checkpoint in {folder}")
        return found
    matches = [c for c in list_checkpoints(folder) if c.round == round_]
    if not matches:
        kept = ", ".join(str(c.round) for c in list_checkpoints(folder)) or "none"
        raise ValueError(f"no checkpoint of round {round_} in {folder} (kept: {kept})")
    return matches[0], load_checkpoint(matches[0].path)


def global_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint's model state with the global parameters in place of the local ones,
    under the model's own names (see the module docstring).

    Raises:
        ValueError: a checkpoint that does not match its fragment plan.
    """
    plan = _plan(state)
    model: dict[str, torch.Tensor] = state["model"]
    tensors: dict[str, torch.Tensor] = {}
    by_storage: dict[int, str] = {}
    for frag, vector in zip(plan.fragments, state["outer"]["globals"]):
        offset = 0
        for name, shape in zip(frag.names, frag.shapes):
            n = int(torch.Size(shape).numel())
            local = model[name]
            tensors[name] = vector[offset : offset + n].reshape(shape).to(local.dtype).clone()
            by_storage[local.untyped_storage().data_ptr()] = name
            offset += n
    for name, value in model.items():
        if name in tensors:
            continue
        # a name that shares its tensor with a synced parameter (tied weights) gets the
        # global value too; anything else (buffers) is the node's own
        twin = by_storage.get(value.untyped_storage().data_ptr())
        tensors[name] = (tensors[twin] if twin else value).detach().contiguous().clone()
    return tensors


def export_model(data_dir: Path, out: Path, round_: int | None = None) -> dict[str, Any]:
    """Write the global parameters of the newest valid checkpoint (or of ``round_``) to
    ``out`` in safetensors format; returns what was written.

    Raises:
        ValueError: no checkpoint (of that round), or one that does not match its plan.
        CheckpointError: the checkpoint of ``round_`` is damaged.
    """
    from safetensors.torch import save_file

    info, state = load_state(data_dir, round_)
    tensors = global_tensors(state)
    metadata = {
        "format": FORMAT,
        "parameters_sha256": parameters_digest(tensors),
        **checkpoint_metadata(info, state),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    return {"path": str(out), "tensors": len(tensors), **metadata}


def checkpoint_metadata(info: CheckpointInfo, state: dict[str, Any]) -> dict[str, str]:
    """Where exported parameters come from: round, run, global digest, plan, file."""
    return {
        "round": str(state["round"]),
        "run_id": str(state.get("run_id", "")),
        "global_digest": str(state.get("global_digest", "")),
        "plan": str(state["plan"]),
        "checkpoint": info.path.name,
    }
