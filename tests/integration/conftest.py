"""Real node processes on 127.0.0.1, always stopped and reaped, children included."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from tests.netlab import NetLab, cleanup_stale, netlab_available
from tests.waiting import wait_until

SMALL = [
    "run.run_id='itest'",
    *QUICK_WORKLOAD,
    "sync.trigger='steps'",
    "sync.inner_steps=10",
    "sync.fragments=2",
    "sync.codec='int8'",
    # Momentum 0.9 overshoots on this tiny workload within three rounds (bits per byte
    # go down, then up), which would drown the differences the tests look for.
    "outer.momentum=0.5",
    "network.matchmaking_seconds=6",
    "network.round_timeout=8",
    "network.request_timeout=8",
    # Every node of a test swarm waits for all the others before it trains: make test runs
    # two tests at a time, and five nodes starting beside another test's swarm were seen
    # to take over the default minute, the first one then training three rounds alone.
    "network.min_peers_timeout=150",
]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Swarm:
    """Launches nodes for one test and guarantees they and their children are gone after."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.nodes: list[swarm.SwarmProcess] = []
        self.helper_pids: set[int] = set()

    def spec(
        self,
        nodes: int,
        rounds: int,
        extra: list[str] = (),
        args: dict[int, list[str]] | None = None,
        procs_per_node: int = 1,
    ) -> swarm.SwarmSpec:
        return swarm.SwarmSpec(
            nodes=nodes,
            config_paths=[],
            overrides=SMALL + list(extra),
            directory=self.directory,
            rounds=rounds,
            extra_args=dict(args or {}),
            procs_per_node=procs_per_node,
        )

    def launch(
        self,
        nodes: int,
        rounds: int,
        extra: list[str] = (),
        args: dict[int, list[str]] | None = None,
        procs_per_node: int = 1,
    ) -> list[swarm.SwarmProcess]:
        self.last_spec = self.spec(nodes, rounds, extra, args, procs_per_node)
        self.nodes += swarm.launch(self.last_spec)
        return self.nodes

    def start_one(
        self, index: int, rounds: int, extra: list[str] = (), peers: list[str] = (), nodes: int = 1
    ) -> swarm.SwarmProcess:
        node = swarm.start_node(self.spec(nodes, rounds, extra), index, list(peers))
        self.nodes.append(node)
        return node

    def record_helpers(self) -> None:
        for n in self.nodes:
            self.helper_pids.update(n.status.get("helper_pids", []))
            # a site's ranks are children of its torchrun agent
            with contextlib.suppress(psutil.NoSuchProcess):
                if n.proc.poll() is None:
                    kids = psutil.Process(n.proc.pid).children(recursive=True)
                    self.helper_pids.update(k.pid for k in kids)

    def wait_all(self, timeout: float) -> bool:
        ok = wait_until(lambda: all(n.proc.poll() is not None for n in self.nodes), timeout, 0.5)
        self.record_helpers()
        return ok

    def summary(self) -> dict:
        cfg = load_config(None, SMALL)
        spec = getattr(self, "last_spec", None)
        byzantine = sorted(spec.extra_args_byzantine()) if spec else []
        return swarm.summarize(self.nodes, cfg, byzantine)

    def leftovers(self) -> list[int]:
        procs = [n.proc.pid for n in self.nodes if n.proc.poll() is None]
        return procs + [p for p in self.helper_pids if alive(p)]

    def close(self) -> None:
        self.record_helpers()
        swarm.stop_all([n for n in self.nodes if not n.log.closed], grace=20)
        wait_until(lambda: not self.leftovers(), 20)
        for pid in self.leftovers():  # the test fails below; never leave processes behind
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[Swarm]:
    s = Swarm(tmp_path / "swarm")
    try:
        yield s
    finally:
        s.close()
    assert not s.leftovers(), f"processes left behind: {s.leftovers()}"


def _open_lab() -> NetLab:
    ok, reason = netlab_available()
    if not ok:
        pytest.skip(f"netlab unavailable: {reason}")
    cleanup_stale()  # namespaces a crashed earlier run left behind
    return NetLab()


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    """A fresh multi-host lab for one test, always torn down (processes, namespaces)."""
    lab = _open_lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def netlab_module() -> Iterator[NetLab]:
    """One lab shared by a module's tests; give each test its own host names."""
    lab = _open_lab()
    try:
        yield lab
    finally:
        lab.close()
