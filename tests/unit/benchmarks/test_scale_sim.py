"""The swarm simulator: the protocol's groups, exact mixing, analytic bytes and control load."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest

from benchmarks import _scale_sim as sim
from benchmarks._scale_sim import (
    ADAPTIVE_POLICY,
    CURRENT_POLICY,
    ControlPolicy,
    SimConfig,
    Site,
    butterfly_schedule,
    calibrate,
    control_load,
    simulate,
)
from protocol.averaging.grouping import Cell, cell_groups, form_groups, rounds_to_mix
from verification.identity import Identity

_HERE = (Site("here", 0.0, 0.0),)
# One site, identical nodes, small fragments: every round is clean and quick.
_CLEAN = SimConfig(
    sites=_HERE,
    fragments=1,
    fragment_bytes=1e6,
    model_bytes=4e6,
    inner_steps=10,
    step_seconds=0.1,
    step_spread=0.0,
    step_jitter=0.0,
)


def _names(n: int) -> list[str]:
    return [f"p{i:05d}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 7, 8, 16, 27, 64, 100])
@pytest.mark.parametrize("group_size", [2, 4])
def test_butterfly_schedule_is_the_protocols_grouping(n: int, group_size: int) -> None:
    peers = _names(n)
    for fragment in range(3):
        schedule = butterfly_schedule(peers, 5, fragment, group_size)
        expected = [form_groups(peers, r, fragment, group_size, "butterfly") for r in range(5)]
        assert schedule == expected
        later = butterfly_schedule(reversed(peers), [7, 11], fragment, group_size)
        assert later == [form_groups(peers, r, fragment, group_size, "butterfly") for r in (7, 11)]


def test_the_simulator_groups_nodes_with_the_butterfly_schedule(monkeypatch) -> None:
    seen: list[tuple[list[str], int, int, list[list[str]]]] = []
    schedule = sim.butterfly_schedule

    def spy(peers, rounds, fragment, group_size):
        peers, rounds = list(peers), list(rounds)
        out = schedule(peers, rounds, fragment, group_size)
        seen.append((peers, rounds[0], fragment, out[0]))
        return out

    monkeypatch.setattr(sim, "butterfly_schedule", spy)
    simulate(dataclasses.replace(_CLEAN, fragments=2, group_size=2), 16, 3, seed=0)
    assert [(r, f) for _, r, f, _ in seen] == [(r, f) for r in (1, 2, 3) for f in (0, 1)]
    for peers, r, f, groups in seen:
        assert sorted(peers) == _names(16)
        assert groups == form_groups(peers, r, f, 2, layout="butterfly")


@pytest.mark.parametrize(("n", "group_size"), [(16, 2), (16, 4), (64, 4), (27, 3), (5, 8)])
def test_every_contribution_reaches_every_node_after_rounds_to_mix(n: int, group_size: int) -> None:
    cfg = dataclasses.replace(_CLEAN, group_size=group_size)
    mix = rounds_to_mix(n, group_size)
    assert mix is not None
    out = simulate(cfg, n, mix + 1, seed=1)
    assert out["mix_rounds"] == mix and out["mix_exact_butterfly"]
    assert out["included_share"] == 1.0
    assert out["reach_share"] == 1.0 and out["fully_mixed"] is True
    if mix > 1:  # one round short of the schedule, some pairs have not met yet
        short = simulate(cfg, n, mix - 1, seed=1)
        assert short["reach_share"] < 1.0 and short["fully_mixed"] is False


def test_churn_lowers_the_share_that_reaches_the_global_average() -> None:
    calm = simulate(_CLEAN, 64, 6, seed=2)
    churned = simulate(dataclasses.replace(_CLEAN, churn=0.1), 64, 6, seed=2)
    assert calm["reach_share"] == 1.0
    assert churned["left"] > 0 and churned["joined"] > 0
    assert churned["included_share"] < 1.0
    assert churned["reach_share"] < 0.9
    assert churned["resync_bytes_per_node_round"] > 0  # joiners fetched the state


def test_wall_clock_rounds_keep_a_churning_swarm_in_phase() -> None:
    """Under churn, step-triggered rounds drift apart (a node whose sync failed starts
    its next round early and misses its line's view again), wall-clock rounds do not:
    on the cell grid at 5 % churn, nearly every contribution is included and reaches
    nearly every node after log_G n + 2 rounds."""
    cfg = dataclasses.replace(SimConfig(), churn=0.05, control=sim.NODE_POLICY)
    steps = simulate(cfg, 600, 7, seed=1, mix_rounds=7)
    wall = simulate(dataclasses.replace(cfg, round_seconds=120.0), 600, 7, seed=1, mix_rounds=7)
    assert wall["mix_rounds"] == 7 and wall["left"] > 0 and wall["joined"] > 0
    assert wall["included_share"] > 0.95 and wall["reach_share"] > 0.95
    assert steps["reach_share"] < 0.6 < wall["reach_share"]
    # training never waits for a result on the wall clock: every round is the round length
    assert wall["round_seconds_mean"] == pytest.approx(120.0, rel=0.01)  # joiners: less
    assert wall["utilization"] > 0.99


def test_a_wall_clock_exchange_that_outlasts_its_round_fails() -> None:
    """Four nodes in one group: a sync not back by 95 % of a round after its launch
    failed, and (one group spanning the swarm) the node re-syncs at the round's end."""
    fast = dataclasses.replace(_CLEAN, group_size=4, round_seconds=20.0)
    assert simulate(fast, 4, 2, seed=0)["resyncs"] == 0
    slow = dataclasses.replace(fast, upload_gbit=1e-4, download_gbit=1e-4)  # 2 min a part
    out = simulate(slow, 4, 2, seed=0)
    # every node after round 1; the download over that link outlasts round 2, which they
    # sit out fetching (as a joiner does)
    assert out["resyncs"] == 4
    assert out["round_seconds_mean"] > 20.0


@pytest.mark.parametrize(("group_size", "fragments"), [(2, 1), (4, 1), (4, 3)])
def test_bytes_per_node_per_clean_round_are_2_g_minus_1_over_g_of_each_fragment(
    group_size: int, fragments: int
) -> None:
    cfg = dataclasses.replace(_CLEAN, group_size=group_size, fragments=fragments)
    out = simulate(cfg, 16, 3, seed=0)
    analytic = fragments * 2 * (group_size - 1) / group_size * cfg.fragment_bytes
    assert out["bytes_sent_per_node_round"] == pytest.approx(analytic)
    assert out["repair_bytes_per_node_round"] == 0 and out["resync_bytes_per_node_round"] == 0


def test_a_slower_link_gives_a_longer_round_by_the_transfer_time() -> None:
    big = dataclasses.replace(_CLEAN, group_size=4, fragment_bytes=1e8)
    fast = simulate(dataclasses.replace(big, upload_gbit=1.0, download_gbit=1.0), 16, 3)
    slow = simulate(dataclasses.replace(big, upload_gbit=0.1, download_gbit=0.1), 16, 3)
    # Each phase sends 3 parts of V/4 at a third of the link: 0.75 V / rate, twice.
    per_phase = 0.75 * big.fragment_bytes
    expected = 2 * per_phase / (0.1e9 / 8) - 2 * per_phase / (1e9 / 8)
    assert slow["round_seconds_mean"] - fast["round_seconds_mean"] == pytest.approx(expected)
    assert slow["utilization"] < fast["utilization"]


def test_distance_adds_5_us_per_km_to_each_transfer() -> None:
    near = dataclasses.replace(_CLEAN, sites=(Site("a", 0.0, 0.0), Site("b", 0.0, 0.0)))
    far = dataclasses.replace(_CLEAN, sites=(Site("a", 0.0, 0.0), Site("b", 0.0, 90.0)))
    one_way = sim._site_delays(far)[0, 1] - sim._site_delays(near)[0, 1]
    assert one_way == pytest.approx(10_007.5 * 5e-6, rel=1e-3)  # a quarter of the equator
    far_s, near_s = simulate(far, 16, 2), simulate(near, 16, 2)
    slower = far_s["round_seconds_mean"] - near_s["round_seconds_mean"]
    # The matchmaking lookup: 2 x log2(16) one-way delays at the mean (half the pairs are
    # far): 4; a group spanning both sites adds its parts and results: 2 more.
    assert 4 * one_way < slower <= 6 * one_way * (1 + 1e-9)


def test_a_crashed_member_costs_its_group_the_request_timeout() -> None:
    churn = dataclasses.replace(_CLEAN, churn=0.2, request_timeout=20.0)
    clean_exit = simulate(dataclasses.replace(churn, crash_share=0.0), 64, 4, seed=3)
    crashes = simulate(dataclasses.replace(churn, crash_share=1.0), 64, 4, seed=3)
    assert crashes["repair_bytes_per_node_round"] > 0
    assert crashes["round_seconds_p95"] > clean_exit["round_seconds_p95"] + 10.0


def _per_node_load(policy: ControlPolicy, n: int) -> tuple[float, float]:
    cfg = dataclasses.replace(SimConfig(), control=policy)
    load = control_load(cfg, n, round_seconds=100.0, matchmaking_wait_s=1.0)
    cpu = load["control_cpu_s_per_node_round"] + load["dht_cpu_s_per_node_round"]
    return cpu, load["control_bytes_per_node_round"] + load["dht_bytes_per_node_round"]


def test_adaptive_control_load_stays_flat_while_the_current_one_grows_linearly() -> None:
    growth = 10_000 / 16
    log_factor = math.log2(10_000)
    for small, large in zip(
        _per_node_load(CURRENT_POLICY, 16), _per_node_load(CURRENT_POLICY, 10_000), strict=True
    ):
        assert large / small > 0.5 * growth
    for small, large in zip(
        _per_node_load(ADAPTIVE_POLICY, 16), _per_node_load(ADAPTIVE_POLICY, 10_000), strict=True
    ):
        assert large / small < log_factor
    hot = control_load(SimConfig(), 10_000, 100.0)["dht_hotspot_bytes_per_round"]
    bounded = control_load(SimConfig(control=ADAPTIVE_POLICY), 10_000, 100.0)
    assert bounded["dht_hotspot_bytes_per_round"] < hot / 1000
    assert bounded["heartbeat_interval_s"] == pytest.approx(10_000 / 32)


def test_simulate_reports_the_control_load_at_its_round_time() -> None:
    out = simulate(_CLEAN, 16, 2)
    expected = control_load(_CLEAN, 16, out["round_seconds_mean"], out["matchmaking_wait_s"])
    assert out["control"] == pytest.approx(expected)


def test_the_same_seed_gives_the_same_result() -> None:
    cfg = SimConfig(churn=0.1, step_spread=0.05, bandwidth_spread=0.3)
    first = simulate(cfg, 64, 4, seed=7)
    assert simulate(cfg, 64, 4, seed=7) == first
    assert simulate(cfg, 64, 4, seed=8) != first


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: simulate(SimConfig(), 0, 3), "at least 1 node"),
        (lambda: simulate(SimConfig(), 16, 0), "at least 1 round"),
        (lambda: SimConfig(group_size=1), "group_size = 1: expected >= 2"),
        (lambda: SimConfig(upload_gbit=-1.0), "upload_gbit = -1.0: expected > 0"),
        (lambda: SimConfig(download_gbit=0.0), "download_gbit = 0.0: expected > 0"),
        (lambda: SimConfig(churn=1.0), "churn = 1.0"),
        (lambda: SimConfig(round_seconds=0.0), "round_seconds = 0.0"),
        (lambda: simulate(SimConfig(), 16, 3, mix_rounds=0), "mix_rounds = 0"),
        (lambda: SimConfig(sites=()), "sites"),
        (lambda: ControlPolicy(read="most"), "control.read = 'most'"),
        (lambda: control_load(SimConfig(), 0, 10.0), "at least 1 node"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_calibrate_sets_constants_and_fits_the_sync_overhead() -> None:
    truth = dataclasses.replace(_CLEAN, sync_overhead_s=0.9)
    measured = {n: simulate(truth, n, 3)["round_seconds_mean"] for n in (2, 4)}
    cfg = calibrate(
        {"round_seconds": measured, "control_cpu_per_message_s": 3e-3, "bytes_per_fragment": 1e6},
        base=_CLEAN,
    )
    assert cfg.sync_overhead_s == pytest.approx(0.9, abs=1e-3)
    assert cfg.control_cpu_per_message_s == 3e-3 and cfg.fragment_bytes == 1e6
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        calibrate({"bogus": 1.0})


def test_the_node_policy_matches_the_node_up_to_8_and_is_flat_above() -> None:
    from benchmarks._scale_sim import CURRENT_POLICY, NODE_POLICY, SimConfig, control_load

    before, paced = SimConfig(control=CURRENT_POLICY), SimConfig(control=NODE_POLICY)
    for n in (2, 4, 8):
        assert control_load(paced, n, 10.0) == control_load(before, n, 10.0)
    assert NODE_POLICY.heartbeat_interval(16) == 2.0 and NODE_POLICY.registry_interval(16) == 4.0
    beats = [control_load(paced, n, 10.0)["control_messages_per_node_round"] for n in (16, 1024)]
    assert beats[1] == pytest.approx(beats[0], rel=0.07)  # flat, up to (n - 1) / n
    grows = [control_load(before, n, 10.0)["control_messages_per_node_round"] for n in (16, 1024)]
    assert grows[1] > 50 * grows[0]


def test_commitments_reach_every_node_by_gossip_only_in_a_small_swarm() -> None:
    from benchmarks._scale_sim import CURRENT_POLICY, NODE_POLICY, SimConfig, control_load

    cfg = SimConfig(fragments=4, group_size=4, mix_bytes=0.0)
    gossip = SimConfig(fragments=4, group_size=4, mix_bytes=0.0, control=CURRENT_POLICY)
    direct = dataclasses.replace(gossip, control=NODE_POLICY)
    assert cfg.control is CURRENT_POLICY
    # up to 8 nodes both gossip: each of n - 1 commitments reaches a node min(D, n - 1) times
    for n in (4, 8):
        expected = min(6, n - 1) * (n - 1) * 4
        assert control_load(gossip, n, 10.0)["commit_messages_per_node_round"] == expected
        assert control_load(direct, n, 10.0)["commit_messages_per_node_round"] == expected
    # above it the node sends its commitment to the other G - 1 members only
    for n in (16, 10_000):
        assert control_load(direct, n, 10.0)["commit_messages_per_node_round"] == 3 * 4
    assert control_load(gossip, 10_000, 10.0)["commit_messages_per_node_round"] == 6 * 9_999 * 4
    # groups that mix commit to their global copies too
    mixing = dataclasses.replace(direct, mix_bytes=1e6)
    assert control_load(mixing, 16, 10.0)["commit_messages_per_node_round"] == 3 * 4 * 2
    with pytest.raises(ValueError, match="commit_gossip_up_to"):
        ControlPolicy(commit_gossip_up_to=-1)


def test_groups_that_mix_send_their_global_copies_too() -> None:
    base = dataclasses.replace(SimConfig(), churn=0.0, fragments=1, fragment_bytes=1e6)
    mixing = dataclasses.replace(base, mix_bytes=2e6)
    share = 2 * 3 / 4
    one_group = simulate(mixing, 4, 2)["bytes_sent_per_node_round"]
    assert one_group == pytest.approx(share * 1e6)  # one group spans the swarm: no mixing
    assert simulate(mixing, 16, 2)["bytes_sent_per_node_round"] == pytest.approx(share * 3e6)
    assert simulate(base, 16, 2)["bytes_sent_per_node_round"] == pytest.approx(share * 1e6)


def test_on_the_cell_grid_a_node_reads_its_line_not_the_swarm() -> None:
    # today's node: above 256 nodes one announcement read returns the node's line of the
    # grid (2G to 2G^2 peers on average), so what it reads per sync no longer grows with n
    every = dataclasses.replace(sim.NODE_POLICY, cells_above=None)
    for n in (1024, 4096, 10_000):
        line = sim.NODE_POLICY.announcements_read(n, 4)
        assert 2 * 4 - 1 <= line < 2 * 4**2 and every.announcements_read(n, 4) == n - 1
    assert sim.NODE_POLICY.announcements_read(256, 4) == 255  # not above cells_above
    dht = {
        n: control_load(SimConfig(control=sim.NODE_POLICY), n, 100.0, 1.0)[
            "dht_bytes_per_node_round"
        ]
        for n in (1024, 10_000)
    }
    assert dht[10_000] < 1.5 * dht[1024]
    full = control_load(SimConfig(control=every), 10_000, 100.0, 1.0)["dht_bytes_per_node_round"]
    assert full > 10 * dht[10_000]


def test_the_simulator_groups_within_lines_of_the_protocols_cell_grid() -> None:
    seen: list[tuple[int, int, list[str]]] = []
    cfg = dataclasses.replace(_CLEAN, control=ControlPolicy(cells_above=32))
    run = sim._Run(cfg, 100, 2, seed=0)
    exchange_view = run._exchange_view

    def spy(r, f, peers, mine, begin, result, failed, cells=None):
        assert cells == 100  # every node of this clean swarm sees all 100
        names = [run.sw.names[i] for i in peers]
        seen.extend((r, f, g) for g in cell_groups(names, r, f, 4, cells))
        return exchange_view(r, f, peers, mine, begin, result, failed, cells)

    run._exchange_view = spy
    out = run.run()
    assert out["included_share"] == 1.0 and not out["mix_exact_butterfly"]
    for r in (1, 2):  # every node in exactly one group per round
        members = sorted(p for rr, _, g in seen if rr == r for p in g)
        assert members == sorted(run.sw.names[:100])
    for r, f, g in seen:  # each group lies on one line of the protocol's grid
        line = Cell.of(g[0], r, f, 4, 100)
        assert all(line.holds(p) for p in g) and len(g) <= 4
    assert len({Cell.of(g[0], r, f, 4, 100).key for r, f, g in seen if r == 1}) == 4  # G^(dims - 1)


def test_registry_shards_keep_what_its_busiest_holder_serves_flat() -> None:
    # today's node with network.registry_shards = n / 256: every node still reads every
    # record (paced), but each shard's holders serve only their shard's readers' share
    one_key = dataclasses.replace(sim.NODE_POLICY, shard_records=None)
    assert sim.NODE_POLICY.registry_shards(256) == 1
    assert sim.NODE_POLICY.registry_shards(10_000) == 40
    assert one_key.registry_shards(10_000) == 1

    def hotspot(policy: ControlPolicy, n: int) -> float:
        return control_load(SimConfig(control=policy), n, 100.0, 1.0)["dht_hotspot_bytes_per_round"]

    # (compared above cells_above, where matchmaking keys hold a line each)
    assert hotspot(one_key, 10_000) > 5 * hotspot(one_key, 1024)  # grows with n
    assert hotspot(sim.NODE_POLICY, 10_000) < 1.2 * hotspot(sim.NODE_POLICY, 1024)
    assert hotspot(sim.NODE_POLICY, 10_000) < hotspot(one_key, 10_000) / 20
    # what a node itself reads is the same either way; it issues more gets, one per shard
    shard, single = (
        control_load(SimConfig(control=p), 10_000, 100.0, 1.0) for p in (sim.NODE_POLICY, one_key)
    )
    assert shard["dht_records_read_per_node_round"] == single["dht_records_read_per_node_round"]
    assert shard["dht_rpcs_per_node_round"] > single["dht_rpcs_per_node_round"]
    with pytest.raises(ValueError, match="shard_records"):
        ControlPolicy(read="sample", shard_records=256)


def _real_like(n: int, round_seconds: float) -> dict:
    """What benchmarks._scale_real.measure reports, reduced to what the checks read."""
    return {
        "round_seconds_mean": round_seconds,
        "step_seconds": 0.05,
        "bytes_per_round": [300_000.0] * n,
        "load_mean": {
            "node_cpu_s_per_round": 0.3,
            "p2pd_cpu_s_per_round": 0.2,
            "dht_cpu_s_per_round": 0.1,
            "control_cpu_s_per_round": 0.4,
        },
        "syncs": 2 * n,
        "syncs_complete": 2 * n,
    }


def test_the_link_check_simulates_the_shaped_link_and_flags_a_miss() -> None:
    from benchmarks import scale

    constants = {"fragment_bytes": 50_000.0, "mix_bytes": 90_000.0}
    plain = scale._local_config(_real_like(8, 1.0), constants)
    unshaped = sim.simulate(dataclasses.replace(plain, sync_overhead_s=0.3), 8, 3)
    guess = scale._link_check({8: _real_like(8, 1.0)}, constants, 0.3, 3)["sizes"][8]
    # 0.5 Mbit/s uplinks: each round's ~330 kB take seconds more than on loopback
    link_seconds = unshaped["bytes_sent_per_node_round"] * 8 / 0.5e6
    assert guess["sim_round_seconds"] > unshaped["round_seconds_mean"] + 0.8 * link_seconds
    assert guess["cpu_bound_seconds"] == pytest.approx(8 * 1.0 / 2)
    matched = scale._link_check({8: _real_like(8, guess["sim_round_seconds"])}, constants, 0.3, 3)[
        "sizes"
    ][8]
    assert matched["within_target"] and abs(matched["error"]) < 1e-9
    missed = scale._link_check(
        {8: _real_like(8, 2 * guess["sim_round_seconds"])}, constants, 0.3, 3
    )["sizes"][8]
    assert not missed["within_target"] and missed["error"] == pytest.approx(-0.5)


def test_the_cell_check_compares_the_real_grid_with_the_simulated_one() -> None:
    from benchmarks import scale

    real = {
        **_real_like(16, 10.0),
        "included_share": 0.9,
        "mix": {"window": 4, "reach_share": 0.8, "reach_by_fragment": {0: 0.7, 1: 0.9}},
    }
    found = scale._cell_check(real, {"fragment_bytes": 50_000.0}, 0.3, 6)
    assert (found["nodes"], found["group_size"], found["dims"]) == (16, 2, 3)
    assert (found["real_included_share"], found["real_reach_share"]) == (0.9, 0.7)
    assert found["sim_mix_rounds"] == 4  # ceil(log_2 16): the grid promises no exact mix
    assert 0 < found["sim_reach_share"] <= 1 and 0 < found["sim_included_share"] <= 1


def test_the_load_table_takes_each_sizes_means_per_node_and_round() -> None:
    from benchmarks import scale

    real = {n: {**_real_like(n, 20.0), "syncs": 8 * n, "syncs_complete": 8 * n - 1} for n in (4, 8)}
    real[8]["load_mean"] = {**real[8]["load_mean"], "dht_ops_per_round": 14.0}
    table = scale._load_table(real)
    assert set(table) == {4, 8}
    assert table[8]["dht_ops_per_round"] == 14.0 and table[4]["dht_ops_per_round"] is None
    assert table[4]["control_cpu_s_per_round"] == 0.4
    assert table[8]["syncs_complete"] == "63/64"


def _fixed_ids(count: int) -> list[str]:
    """PeerIDs from fixed seeds: the same grid on every run."""
    seeds = (hashlib.sha256(f"sim peer {i}".encode()).digest() for i in range(count))
    return [Identity.from_seed(seed).peer_id for seed in seeds]


def test_a_simulation_can_run_on_a_real_swarms_peer_ids(monkeypatch) -> None:
    # the cell grid places peers by their PeerIDs: given the real ones, the simulator
    # forms the real swarm's groups; other names give another grid and another reach
    cfg = dataclasses.replace(_CLEAN, group_size=2, control=ControlPolicy(cells_above=8))
    ids = _fixed_ids(16)
    seen: list[list[str]] = []
    original = sim.cell_schedule

    def spy(names, r, f, g, cells):
        groups = original(names, r, f, g, cells)
        seen.extend(groups)
        return groups

    monkeypatch.setattr(sim, "cell_schedule", spy)
    sim.simulate(cfg, 16, 2, names=ids)
    assert seen and {p for g in seen for p in g} == set(ids)
    with pytest.raises(ValueError, match="names"):
        sim.simulate(cfg, 16, 2, names=ids + ["one-more"])
    with pytest.raises(ValueError, match="names"):
        sim.simulate(cfg, 16, 2, names=[ids[0], ids[0]])


def test_the_simulators_reach_on_the_grid_is_the_swarm_summarys_on_the_same_groups() -> None:
    # a clean run (no churn, every member in its group's result): the simulator's reach
    # on given PeerIDs equals what node.ops.swarm.butterfly_reach computes from sync events
    # of the same groups, fragment 0, windows of ceil(log_2 16) = 4 rounds
    from node.ops.swarm import butterfly_reach

    ids = _fixed_ids(16)
    cfg = dataclasses.replace(_CLEAN, group_size=2, control=ControlPolicy(cells_above=8))
    simulated = sim.simulate(cfg, 16, 6, names=ids)
    syncs: dict[str, list[dict]] = {p: [] for p in ids}
    for r in range(1, 7):
        for group in cell_groups(ids, r, 0, 2, 16):
            for p in group:
                syncs[p].append(
                    {"round": r, "fragment": 0, "group": group, "contributors": [group]}
                )
    real = butterfly_reach(syncs, group_size=2, cells_above=8)
    assert real["window"] == simulated["mix_rounds"] == 4
    assert real["reach_by_fragment"][0] == pytest.approx(simulated["reach_share"])
