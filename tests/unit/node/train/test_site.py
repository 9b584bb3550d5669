"""A site of several processes: ranks from torchrun's environment, their devices and
data slices, the torchrun command, and the leader keeping two real gloo ranks in step."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys

import pytest
import torch

from node.config import load_config
from node.data.corpus import slice_bounds
from node.train.site import SiteRank, params_digest
from node.train.site_process import site_command


def test_rank_from_torchruns_environment() -> None:
    assert SiteRank.from_env({}) is None
    assert SiteRank.from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    site = SiteRank.from_env({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert site == SiteRank(rank=2, world=4, local_rank=0) and not site.leader
    with pytest.raises(ValueError, match="not a number"):
        SiteRank.from_env({"WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        SiteRank.from_env({"WORLD_SIZE": "2", "RANK": "5"})


def test_each_rank_of_each_site_has_its_own_slice_and_together_they_cover_it() -> None:
    tokens, sites, world = 10_007, 2, 2
    bounds = []
    for site in range(sites):
        for rank in range(world):
            index, count = SiteRank(rank, world, rank).slice_of(site, sites)
            bounds.append(slice_bounds(tokens, index, count))
    assert sorted(bounds) == bounds and bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_rank_devices(monkeypatch) -> None:
    site = SiteRank(1, 2, 1)
    assert site.device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="each rank takes the GPU of its local rank"):
        site.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert site.device("cuda") == torch.device("cuda", 1)
    assert site.device("auto") == torch.device("cuda", 1)


def test_the_site_command_is_torchrun_running_the_same_atoll_run() -> None:
    argv = ["-v", "run", "--config", "c.toml", "--nproc-per-node", "2", "--rounds", "3"]
    cmd = site_command(argv, 2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--max-restarts=0" in cmd and "--standalone" in cmd
    tail = ["-m", "node.cli", "-v", "run", "--config", "c.toml", "--rounds", "3"]
    assert cmd[cmd.index("-m", 3) :] == tail
    assert site_command(["run", "--nproc-per-node=4"], 4)[-2:] == ["node.cli", "run"]
    with pytest.raises(ValueError, match="--nproc-per-node must be >= 1"):
        site_command(argv, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: mp.Queue, sharding: str = "ddp") -> None:
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from node.data.corpus import BatchStream, assigned_stream
    from node.train.model import build_model
    from node.train.site import SiteGroup
    from node.train.site_process import leave
    from node.train.trainer import InnerTrainer

    cfg = load_config(
        None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.context=8"]
    )
    site = SiteRank.from_env()
    assert site is not None
    group = SiteGroup(site, torch.device("cpu"), sharding)
    try:
        key = group.agree_key("leader-key" if site.leader else None)
        trained = build_model(cfg.model, seed=rank)  # different on purpose: the leader's win
        # under FSDP the leader keeps the node's full copy apart from the shards it trains
        full = build_model(cfg.model, seed=7) if sharding == "fsdp" else trained
        data = torch.tensor(list(b"two ranks train in step. " * 20), dtype=torch.uint8)
        stream = BatchStream(data, 2, 8, (key, rank))
        trainer = InnerTrainer(group.wrap(trained), cfg.train, stream, ranks=2)
        if not site.leader:

            def assigned(round_: int) -> BatchStream:
                return assigned_stream(data, 2, 8, "run", key, round_, rank)

            taken = group.follow(trained, trainer, assigned)
            digest = None if sharding == "fsdp" else params_digest(trained)
            out.put(("follower", key, taken, digest, trainer.stream.generator.initial_seed()))
            out.close()
            out.join_thread()
            group.close()
            # a follower ends as `atoll run` ends it: without the interpreter's finalization,
            # where a C++ thread of its process group aborted it now and then
            leave(0)
        group.share_optimizer(trainer.optimizer)
        group.share_params(full, trained)
        for _ in range(3):
            group.step(trainer.steps)
            trainer.step()
        before = params_digest(full)
        group.gather(full, trained)
        trained_moved = params_digest(full) != before or sharding == "ddp"
        with torch.no_grad():  # the leader changes the model outside a step (a sync applied)
            next(full.parameters()).add_(1.0)
        group.share_params(full, trained)
        # every rank now trains the leader's values (under FSDP: its shard of them)
        shared = group.digests(trained) == [params_digest(full)] * 2
        group.assign(5)  # round 5's assigned batches from now on, each rank its own
        group.step(trainer.steps)
        trainer.step()
        group.gather(full, trained)
        digests = group.digests(trained)
        group.stop()
        out.put(("leader", digests, trainer.tokens, params_digest(full), trained_moved and shared))
    finally:
        group.close()


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_leader_keeps_a_follower_rank_bitwise_in_step_over_gloo(sharding: str) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out, sharding)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((item[0], item[1:]) for item in (out.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    digests, tokens, leader_digest, trained_moved = got["leader"]
    key, steps, follower_digest, seed = got["follower"]
    assert key == "leader-key" and steps == 4
    from node.data.corpus import assigned_stream

    data = torch.tensor(list(b"two ranks train in step. " * 20), dtype=torch.uint8)
    assert seed == assigned_stream(data, 2, 8, "run", key, 5, 1).generator.initial_seed()
    assert seed != assigned_stream(data, 2, 8, "run", key, 5, 0).generator.initial_seed()
    assert trained_moved  # the shards trained, and took the leader's values when told
    # every rank ends with the values the leader holds (under FSDP: the gathered shards)
    assert digests == [leader_digest, leader_digest]
    if sharding == "ddp":
        assert follower_digest == leader_digest
    assert tokens == 4 * 2 * 8 * 2  # four steps of a batch of 2 x 8 tokens on each of 2 ranks
    codes = {"leader": procs[0].exitcode, "follower": procs[1].exitcode}
    assert codes == {"leader": 0, "follower": 0}


def test_a_swarm_of_sites_starts_each_node_under_torchrun_with_its_share_of_cores(
    tmp_path, monkeypatch
) -> None:
    from node.ops import swarm

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    spec = swarm.SwarmSpec(
        nodes=2, config_paths=[], overrides=[], directory=tmp_path, rounds=3, procs_per_node=2
    )
    cmd = swarm._node_command(spec, 0, tmp_path / "node0", [])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert "run.threads=2" in cmd  # 8 cores over 2 nodes of 2 ranks
    single = swarm._node_command(
        swarm.SwarmSpec(nodes=2, config_paths=[], overrides=[], directory=tmp_path, rounds=3),
        0,
        tmp_path / "node0",
        [],
    )
    assert "--nproc-per-node" not in single and "run.threads=4" in single


def test_the_swarm_says_whether_every_sites_ranks_agreed() -> None:
    from node.ops.swarm_report import _ranks_agree

    def node(*agree: bool) -> tuple:
        return (None, {}, {r: {"ranks": 2, "ranks_agree": a} for r, a in enumerate(agree)})

    assert _ranks_agree([node(True, True), node(True)]) is True
    assert _ranks_agree([node(True, True), node(True, False)]) is False
    assert _ranks_agree([(None, {}, {1: {"round": 1}})]) is None  # no sites at all
