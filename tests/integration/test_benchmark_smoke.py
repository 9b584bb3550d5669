"""Every benchmark that starts nodes, peers or ranks, run for real at its smoke size.

``run(Mode(smoke=True), tmp_path)`` goes through the benchmark's own code path (its
swarms of real node processes, spawned peers, DDP ranks, report and figure) with 2
nodes or peers and 1 or 2 short rounds, so that a change that breaks a benchmark fails
here instead of at its next real run. Each test asserts the report has no failed
measurement (``benchmarks.__main__.failures``), that its JSON renders in the docs'
tables, that nothing was written into ``benchmarks/results`` and that no node or p2pd
outlived the run; the figures themselves mean nothing at these sizes. ``codec``, which
starts no process, is smoked in ``tests/unit/benchmarks/test_smoke.py``.

A real swarm costs about 25 s here however small (starting and stopping each node
dominates), so ``make test`` smokes the benchmarks that cover the most per second
(verification, convergence, mixing, robustness and its checks mode: about 2.5
minutes) and marks the others ``slow`` (``make test-all``: allreduce's seven methods,
stragglers, sites, scale, models, wan on 127.0.0.1 and in network namespaces,
partitions' 3-minute lab run, islands: DDP ranks, simulated sites and two real
nodes, 2.5 min, sparse: DDP ranks and four simulated runs, 1 min, gpu: a node against
a bare loop and the replicas against their data-parallel reference on the CPU, 1.5 min,
and goodput: two 4-node swarms, one with nodes leaving and joining).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import psutil
import pytest
import torch

from benchmarks import __main__ as bench_cli
from benchmarks import islands, tables
from benchmarks._mode import Mode
from tests.unit.benchmarks.test_smoke import check_smoke_report

pytestmark = [pytest.mark.integration]

SMOKED = {
    "allreduce",
    "join",
    "verification",
    "convergence",
    "robustness",
    "stragglers",
    "wan",
    "mixing",
    "sites",
    "scale",
    "models",
    "partitions",
    "cuda_site",
    "islands",
    "goodput",
    "sparse",
    "gpu",
}
"""The benchmarks smoked here (the unit test checks every registered one is somewhere)."""


def _stamps() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in tables.RESULTS.rglob("*") if p.is_file()}


def _leftovers() -> list[str]:
    """Node, p2pd and rank processes still under this test process."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in line:  # multiprocessing's own, kept for the session
            continue
        if "node.ops.forkserver" in line:  # the launcher's fork server, kept for the session
            continue
        if any(k in line for k in ("node.cli", "p2pd", "multiprocessing", "benchmarks.")):
            found.append(f"{child.pid}: {line[:120]}")
    return found


def smoke(name: str, out: Path, **extra: bool) -> dict:
    """Runs benchmark ``name`` at its smoke size into ``out`` and checks what it gave."""
    before = _stamps()
    report = importlib.import_module(bench_cli.BENCHMARKS[name]).run(Mode(smoke=True, **extra), out)
    assert _stamps() == before, "a smoke run wrote into benchmarks/results"
    assert _leftovers() == []
    if report.get("skipped"):
        pytest.skip(f"{name}: {report['skipped']}")
    check_smoke_report(name, report, out)
    return report


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_allreduce_smoke(tmp_path: Path) -> None:
    report = smoke("allreduce", tmp_path)
    assert report["peers"] == 2
    assert all(r["20000"]["correct"] for r in report["results"].values()), report["results"]


@pytest.mark.timeout(180)
def test_verification_smoke(tmp_path: Path) -> None:
    report = smoke("verification", tmp_path)
    assert report["members"] == 2 and report["results"]["20000/int8"]["ratio"]


@pytest.mark.timeout(180)
def test_convergence_smoke(tmp_path: Path) -> None:
    report = smoke("convergence", tmp_path)
    assert report["mode"] == "smoke" and report["total_steps"] == 10
    assert any(e["setting"]["islands"] for e in report["entries"])


@pytest.mark.timeout(300)
def test_robustness_smoke(tmp_path: Path) -> None:
    report = smoke("robustness", tmp_path)
    (cell,) = report["cells"]
    assert cell["mode"] == "scale" and cell["exit_codes"] == [0, 0], cell


@pytest.mark.slow  # the checks themselves in make test: tests/integration/test_useful_work.py
@pytest.mark.timeout(240)
def test_robustness_checks_smoke(tmp_path: Path) -> None:
    # the checks mode writes robustness-checks.*, which the docs' tables do not list
    before = _stamps()
    report = importlib.import_module(bench_cli.BENCHMARKS["robustness"]).run(
        Mode(smoke=True, checks=True), tmp_path
    )
    assert _stamps() == before, "a smoke run wrote into benchmarks/results"
    assert _leftovers() == []
    assert bench_cli.failures(report) == [], bench_cli.failures(report)
    assert json.loads((tmp_path / "robustness-checks.json").read_text())["smoke"] is True
    assert (tmp_path / "robustness-checks.png").is_file()
    clean, zero = report["runs"]
    assert (clean["checkers"], zero["mode"], zero["exit_codes"]) == (0, "zero", [0] * 4)
    assert zero["checks"]["made"] > 0 and zero["checks"]["bytes_fetched"] > 0, zero["checks"]
    assert zero["checked_rounds"] and zero["checked_rounds"] > 0, zero
    assert report["attacks"]["pairs zero 1_of_4"]["runs"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stragglers_smoke(tmp_path: Path) -> None:
    report = smoke("stragglers", tmp_path)
    assert report["slowdowns"] == [1, 2]
    assert all(m["utilization"] for m in report["methods"].values()), report["methods"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wan_smoke(tmp_path: Path) -> None:
    report = smoke("wan", tmp_path)
    (link,) = report["links"]
    assert link["atoll"]["exit_codes"] == [0, 0] and link["ddp"]["steps_per_worker"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wan_netns_smoke(tmp_path: Path) -> None:
    report = smoke("wan", tmp_path, netns=True)  # skips where no network lab can be built
    assert report["mode"] == "netns"
    assert all(r["atoll"]["wire_bytes_sent_per_worker"] for r in report["links"])


@pytest.mark.timeout(240)
def test_mixing_smoke(tmp_path: Path) -> None:
    report = smoke("mixing", tmp_path)
    assert report["sizes"] == [2] and report["results"]["2"]["butterfly"]["rounds_reached"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sites_smoke(tmp_path: Path) -> None:
    report = smoke("sites", tmp_path)
    assert report["setups"]["sites"]["procs_per_node"] == 2 and report["bytes_ratio"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_scale_smoke(tmp_path: Path) -> None:
    report = smoke("scale", tmp_path)
    data = json.loads((tmp_path / "scale.json").read_text())
    assert tables.scale_load_table(data) and tables.scale_simulated_table(data)
    assert set(report["real"]) == {2} and report["cells"]["rounds_reached"] == 2


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_models_smoke(tmp_path: Path) -> None:
    report = smoke("models", tmp_path)
    assert report["throughput"]["ratio"] and report["convergence"]["entries"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_site_smoke(tmp_path: Path) -> None:
    report = smoke("cuda_site", tmp_path)
    assert report["finished"] and report["ranks_agree"], report


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_partitions_smoke(tmp_path: Path) -> None:
    # one run of three minutes in a network lab, like the partitions test it repeats
    report = smoke("partitions", tmp_path)
    assert report["of"] == 1


@pytest.mark.slow  # joining a running swarm in make test: test_join.py
@pytest.mark.timeout(480)
def test_goodput_smoke(tmp_path: Path) -> None:
    report = smoke("goodput", tmp_path)
    calm, churned = report["rows"]
    assert calm["left"] == calm["joined"] == 0 and calm["goodput"] > 0.8, calm
    assert churned["nodes_started"] == 4 + churned["joined"], churned
    assert 0 < churned["goodput"] <= 1 and churned["tokens"]["trained"] > 0, churned


@pytest.mark.slow  # joining by address in make test: test_join.py, test_multihost.py
@pytest.mark.timeout(240)
def test_join_smoke(tmp_path: Path) -> None:
    report = smoke("join", tmp_path)
    row = report["rows"]["127.0.0.1"]
    assert row["joins"] == 1 and row["succeeded"] == 1, report["joins"]
    assert set(report["rows_not_run"]) == {"127.0.0.1, 100 ms one way", "behind NAT"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_islands_smoke(tmp_path: Path) -> None:
    report = smoke("islands", tmp_path)
    arms = report["summary"]["small"]
    assert set(arms) == {
        "ddp",
        "two sites, AdamW",
        "two sites, SOAP",
        "eight cells in pairs, AdamW",
    }
    # every arm trained and was scored at every round's end, DDP at the same steps
    entry = report["entries"][0]
    steps = [h["step"] for h in entry["ddp"]["history"]]
    for arm in arms:
        assert [h["step"] for h in entry[arm]["history"]] == steps == [0, 10, 20]
        assert entry[arm]["history"][-1]["val_bpb"] < entry[arm]["history"][0]["val_bpb"]
    assert (
        entry["two sites, AdamW"]["batch"] == 8
        and entry["eight cells in pairs, AdamW"]["batch"] == 2
    )
    assert "| small | two sites, AdamW |" in islands.table(report)
    # the two-site arm again as two real nodes: both trained every round, on one state
    (check,) = report["reference_checks"]
    assert check["real"]["exit_codes"] == [0, 0] and check["real"]["rounds"] == [2, 2]
    assert check["real"]["digests_agree"] and len(check["reference_val_bpb_end"]) == 3
    assert abs(check["difference_percent"]) < 5.0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sparse_smoke(tmp_path: Path) -> None:
    report = smoke("sparse", tmp_path)
    arms = report["summary"]["arms"]
    assert set(arms) == {
        "ddp", "int8 H=2", "topk 3% 2b H=2", "int8 H=10", "topk 3% 2b H=10",
        "topk 3% 2b gather H=2",
    }  # fmt: skip
    # topk sends fewer bits a sync than int8, heads and indices counted; both far below fp32
    for h in (2, 10):
        topk, int8 = arms[f"topk 3% 2b H={h}"], arms[f"int8 H={h}"]
        assert topk["bits_per_param_per_sync"] < int8["bits_per_param_per_sync"] / 4
        assert topk["outer_steps"] == int8["outer_steps"] == 20 // h
    assert int8["bits_per_param_per_sync"] < arms["ddp"]["bits_per_param_per_step"] / 2
    # a gather of two sends its part and no result: fewer bytes than the owners' reduce
    gathered, reduced = arms["topk 3% 2b gather H=2"], arms["topk 3% 2b H=2"]
    assert gathered["bits_per_param_per_sync"] < reduced["bits_per_param_per_sync"]
    assert gathered["bits_per_param_per_sync"] == reduced["allgather_bits_per_param_per_sync"]
    assert all("meets_goal" in g for g in report["goals"].values()) and report["goals"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_study_smoke_on_the_cpu(tmp_path: Path) -> None:
    report = smoke("gpu", tmp_path)
    assert report["node_against_bare"]["node_exit_code"] == 0
    assert report["node_against_bare"]["node_tokens_per_second"] > 0
    replicas = report["replicas"]
    # both arms were scored on the very same windows before training
    assert (
        replicas["diloco"]["history"][0]["val_bpb"]
        == replicas["data_parallel"]["history"][0]["val_bpb"]
    )
    assert replicas["diloco"]["tokens"] == replicas["data_parallel"]["tokens"]
    assert report["gpu"] is None and "skipped" in report["cuda_site"]
