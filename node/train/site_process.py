"""The processes of a site: torchrun's command line, a follower rank's life, and a rank
that does not outlive its site (:mod:`node.train.site` keeps the ranks in step)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from node.train.site import SiteGroup, SiteRank, rank_data, stream_key

__all__ = ["die_with_parent", "leave", "run_follower", "site_command"]

logger = logging.getLogger(__name__)


def die_with_parent(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent (torchrun's
    agent) dies, so no rank outlives its site (Linux; elsewhere nothing is done).

    torchrun starts each rank in a session of its own: an agent killed outright would
    otherwise leave its ranks running."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signum, 0, 0, 0) != 0:
        logger.warning("cannot ask to be stopped with torchrun's agent (prctl failed)")
        return
    if os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signum)


def leave(code: int) -> NoReturn:
    """End this follower rank now with ``code``, its log and output flushed, skipping the
    interpreter's finalization.

    After a clean stop (the leader's order, the process group closed) a rank was seen to
    abort while the interpreter tore down, now and then ("terminate called without an
    active exception", SIGABRT, from a C++ thread of the site's process group or its
    DDP/FSDP wrapper): torchrun then reports the whole site failed. A follower holds no
    files or network of its own, so nothing is lost by not finalizing."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_follower(cfg: Any, site: SiteRank) -> int:
    """A follower rank: train in step with the leader until it stops; an exit code."""
    from node.data.corpus import BatchStream, assigned_stream, load_data
    from node.train.bindings import bind
    from node.train.model import build_model, vocab_of
    from node.train.trainer import InnerTrainer

    cfg = bind(cfg)  # the leader's model: the vocabulary a preset takes from the data
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    device = site.device(cfg.run.device)
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    group = SiteGroup(site, device, cfg.train.sharding)
    try:
        key = group.agree_key(None)
        model = build_model(cfg.model, seed=cfg.run.seed).to(device)
        own = rank_data(cfg, corpus.train, site)
        batch, context, run = cfg.data.batch_size, cfg.model.context, cfg.run.run_id
        stream = BatchStream(own, batch, context, stream_key(key, site))
        trained = group.wrap(model)
        trainer = InnerTrainer(trained, cfg.train, stream, device, ranks=site.world)

        def assigned(round_: int) -> BatchStream:
            return assigned_stream(own, batch, context, run, key, round_, site.rank)

        steps = group.follow(model, trainer, assigned)
        logger.info("rank %d: stopped by the leader after %d inner steps", site.rank, steps)
        return 0
    finally:
        group.close()


def site_command(argv: Sequence[str], nproc: int) -> list[str]:
    """The torchrun command that runs ``atoll ARGV`` (an ``atoll run`` with
    ``--nproc-per-node``) as a site of ``nproc`` ranks on this machine.

    torchrun does not restart the ranks itself (``--max-restarts=0``): a site that lost
    a rank stops, and is started again as a whole (by its service manager), resuming
    from its checkpoint. (Restarted in place, the new ranks hung while forming their
    gloo group in tests here.)"""
    if nproc < 1:
        raise ValueError("--nproc-per-node must be >= 1")
    rest: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc-per-node":
            skip = True
            continue
        if arg.startswith("--nproc-per-node="):
            continue
        rest.append(arg)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        "node.cli",
        *rest,
    ]
