"""The processes of a site: a rank does not outlive the process that started it.

(torchrun's command line, :func:`node.train.site_process.site_command`, is checked in
``test_site.py`` beside the site it starts.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[4]

_RANK = textwrap.dedent(
    """
    import signal, time
    from node.train.site_process import die_with_parent
    die_with_parent(signal.SIGKILL)
    print("armed", flush=True)
    time.sleep(60)
    """
)

_AGENT = textwrap.dedent(
    """
    import subprocess, sys
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline().strip() == "armed"
    print(rank.pid, flush=True)
    """
)  # the agent exits at once, leaving its rank behind


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_rank_dies_with_the_agent_that_started_it() -> None:
    agent = subprocess.run(
        [sys.executable, "-c", _AGENT, _RANK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode == 0, agent.stderr
    rank = int(agent.stdout.strip())
    try:
        assert wait_until(lambda: _gone(rank), 10, 0.05)
    finally:
        if not _gone(rank):
            psutil.Process(rank).kill()


_LEAVER = textwrap.dedent(
    """
    import atexit, logging, sys
    from node.train.site_process import leave
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    atexit.register(lambda: print("finalized", flush=True))
    logging.getLogger("rank").info("stopped by the leader")
    print("partial line", end="")
    leave(3)
    """
)


def test_a_rank_leaves_with_its_code_and_its_log_flushed_without_finalizing(tmp_path) -> None:
    log = tmp_path / "rank.log"
    done = subprocess.run(
        [sys.executable, "-c", _LEAVER, str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "partial line"  # flushed, and no exit handler ran
    assert "stopped by the leader" in log.read_text()
