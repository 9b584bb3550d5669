"""The agreed global parameters out of a node's checkpoints: ``atoll export`` (a
safetensors file or a ``from_pretrained`` folder) and ``atoll sample`` (a continuation
of a prompt)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["cmd_export", "cmd_sample"]


def cmd_export(args: argparse.Namespace) -> int:
    """``atoll export``: write a checkpoint's global parameters."""
    data_dir = Path(args.data_dir).expanduser()
    if args.format == "hf":
        from node.ops.handoff import export_hf

        done = export_hf(data_dir, Path(args.out), args.round, force=args.force)
        print(
            f"wrote {done['path']}: a {done['model_type']} model of {done['tensors']} tensors "
            f"and its tokenizer, the global parameters of round {done['round']} (run "
            f"{done['run_id'] or '?'}, from {done['checkpoint']}); load it with "
            f"AutoModelForCausalLM.from_pretrained({done['path']!r})"
        )
        if done["auto_tokenizer"]:
            print(
                f"note: AutoTokenizer.from_pretrained picks {done['auto_tokenizer']} for a "
                f"{done['model_type']} model, which splits text its own way; load the tokenizer "
                f"the model was trained with by PreTrainedTokenizerFast.from_pretrained"
                f"({done['path']!r})"
            )
        return 0
    from node.ops.export import export_model

    done = export_model(data_dir, Path(args.out), args.round)
    print(
        f"wrote {done['path']}: {done['tensors']} tensors, the global parameters of round "
        f"{done['round']} (run {done['run_id'] or '?'}, from {done['checkpoint']}; global "
        f"state digest {done['global_digest'][:16] or 'not recorded'})"
    )
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    """``atoll sample``: continue a prompt from the agreed global parameters."""
    from node.ops.handoff import sample

    text, source = sample(
        Path(args.data_dir).expanduser(),
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        round_=args.round,
    )
    print(
        f"# round {source['round']} of run {source['run_id'] or '?'} ({source['checkpoint']})",
        file=sys.stderr,
    )
    print(f"{args.prompt}{text}")
    return 0
