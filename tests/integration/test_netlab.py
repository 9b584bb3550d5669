"""The multi-host lab: real TCP between namespaces, NAT, rate caps, and complete cleanup."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from tests import netlab as netlab_mod
from tests.netlab import CommandError, Host, NetLab, cleanup_stale, netlab_available
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PORT = 5001  # every host is its own namespace, so a fixed port never clashes
MB = 1 << 20

# Receives up to argv[1] bytes on PORT from one connection, replies "ok <n>", then prints
# the peer's address, the byte count and the seconds from first to last byte.
_SERVE = f"""
import socket, sys, time
size, limit = int(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + limit
srv = socket.create_server(("0.0.0.0", {PORT}))
srv.settimeout(limit)
conn, (peer, _) = srv.accept()
conn.settimeout(limit)
n, first = 0, None
while n < size and time.monotonic() < deadline:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    first = first or time.monotonic()
    n += len(chunk)
elapsed = time.monotonic() - first
conn.sendall(b"ok %d" % n)
print(peer, n, elapsed)
"""

# Sends argv[2] bytes to argv[1]:PORT (retrying while the server is not listening yet)
# and prints the server's reply.
_SEND = f"""
import socket, sys, time
host, size = sys.argv[1], int(sys.argv[2])
for _ in range(50):
    try:
        conn = socket.create_connection((host, {PORT}), timeout=10)
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
else:
    sys.exit("server never listened")
block = b"x" * (1 << 16)
for start in range(0, size, len(block)):
    conn.sendall(block[: size - start])
conn.shutdown(socket.SHUT_WR)
print(conn.recv(64).decode())
"""

# Tries one connection to argv[1]:PORT within argv[2] seconds; prints how it went.
_PROBE = f"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], {PORT}), timeout=float(sys.argv[2])).close()
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""

_LISTEN = f"import socket, time; s = socket.create_server(('0.0.0.0', {PORT})); time.sleep(60)"


def transfer(lab: NetLab, src: Host, dst: Host, size: int) -> tuple[str, float]:
    """Send ``size`` bytes from ``src`` to ``dst``; return the peer ``dst`` saw and Mbit/s."""
    server = lab.popen(
        dst, [sys.executable, "-c", _SERVE, str(size), "20"], stdout=subprocess.PIPE, text=True
    )
    client = lab.run(src, [sys.executable, "-c", _SEND, dst.ip, str(size)], timeout=25)
    out, _ = server.communicate(timeout=25)
    assert server.returncode == 0 and client.stdout.strip() == f"ok {size}", (out, client)
    peer, n, elapsed = out.split()
    assert int(n) == size
    return peer, size * 8 / float(elapsed) / 1e6


def probe(lab: NetLab, src: Host, address: str, timeout: float = 1.0) -> str:
    return lab.run(src, [sys.executable, "-c", _PROBE, address, str(timeout)]).stdout.strip()


def wait_listening(lab: NetLab, host: Host) -> None:
    listening = wait_until(lambda: probe(lab, host, host.ip) == "connected", 5.0, 0.1)
    assert listening, f"nothing listening on {host.name}:{PORT}"


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_public_hosts_reach_each_other(netlab_module: NetLab) -> None:
    a, b = netlab_module.add_host("a"), netlab_module.add_host("b")
    assert a.ip != b.ip and a.public_ip == a.ip and not a.behind_nat
    assert transfer(netlab_module, a, b, 1000)[0] == a.ip
    assert transfer(netlab_module, b, a, 1000)[0] == b.ip


def test_nat_host_connects_out_but_not_in(netlab_module: NetLab) -> None:
    pub, inside = netlab_module.add_host("pub"), netlab_module.add_nat_host("inside")
    assert inside.behind_nat and inside.ip.startswith("192.168.")
    assert inside.public_ip != inside.ip

    peer, _ = transfer(netlab_module, inside, pub, 1000)
    assert peer == inside.public_ip  # masqueraded behind the router

    netlab_module.popen(inside, [sys.executable, "-c", _LISTEN])
    wait_listening(netlab_module, inside)
    assert probe(netlab_module, pub, inside.ip) == "OSError"  # no route: unreachable
    assert probe(netlab_module, pub, inside.public_ip) == "ConnectionRefusedError"  # no forward
    # Even with a route through the router, the NAT drops connections opened from outside.
    netlab_module.run(pub, ["ip", "route", "add", f"{inside.ip}/32", "via", inside.public_ip])
    started = time.monotonic()
    assert probe(netlab_module, pub, inside.ip, timeout=1.0) == "TimeoutError"
    assert time.monotonic() - started < 10


def test_shaped_link_runs_at_its_rate(netlab: NetLab) -> None:
    slow, a, b = netlab.add_host("slow", rate_mbit=20), netlab.add_host("a"), netlab.add_host("b")
    nat = netlab.add_nat_host("nat")
    netlab.shape(nat, 20)
    rates = {
        "egress": transfer(netlab, slow, a, 4 * MB)[1],
        "ingress": transfer(netlab, a, slow, 4 * MB)[1],
        "nat egress": transfer(netlab, nat, a, 4 * MB)[1],
        "uncapped": transfer(netlab, b, a, 4 * MB)[1],
    }
    print("measured Mbit/s:", {k: round(v, 1) for k, v in rates.items()})
    for name in ("egress", "ingress", "nat egress"):
        assert 0.5 * 20 < rates[name] < 1.3 * 20, rates
    assert rates["uncapped"] > 3 * 20, rates

    netlab.unshape(slow)
    assert transfer(netlab, slow, a, 4 * MB)[1] > 3 * 20


def test_close_removes_everything(netlab: NetLab) -> None:
    links_before = root_links()
    lab = NetLab()
    try:
        a = lab.add_host("a", rate_mbit=50)
        lab.add_nat_host("n")
        # A process group with a child that ignores SIGTERM: close() must still end both.
        ignoring = "trap '' TERM; sleep 60 & wait"
        leader = lab.popen(a, ["sh", "-c", ignoring])
        assert wait_until(lambda: psutil.Process(leader.pid).children(), 10, 0.05)
        pids = [leader.pid, *(c.pid for c in psutil.Process(leader.pid).children())]
        assert len(pids) == 2
        made = set(lab.namespaces)
        assert len(made) == 4 and made <= netns_names()  # switch, a, router, n
        assert lab.subnet != netlab.subnet
    finally:
        lab.close()
    assert not made & netns_names()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert root_links() == links_before
    lab.close()  # idempotent
    with pytest.raises(ValueError):
        lab.popen(a, ["true"])


@pytest.fixture
def available() -> None:
    """Skip a test that builds its own labs where no lab can be built."""
    ok, reason = netlab_available()
    if not ok:
        pytest.skip(f"netlab unavailable: {reason}")


@pytest.mark.usefixtures("available")
def test_close_after_failure_mid_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlab_mod, "_NAT_RULES", "table ip broken {{ nonsense {inside} }}")
    with pytest.raises(CommandError) as failure, NetLab() as lab:
        lab.add_host("a")
        lab.add_nat_host("n")  # namespaces and veths exist when nft rejects the rules
    assert "nft" in str(failure.value) and "Error" in str(failure.value)
    assert not any(ns.startswith(f"{lab.lab_id}-") for ns in netns_names())
    assert not lab.namespaces


@pytest.mark.usefixtures("available")
def test_cleanup_stale_removes_only_dead_labs() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"atl{dead.pid}x0-a", "atl1x0-a"  # pid 1 is always alive
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed and live not in removed
        assert live in netns_names() and stale not in netns_names()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@pytest.mark.usefixtures("available")
def test_explicit_subnet_and_bad_names() -> None:
    with NetLab("10.99.7.0/24") as lab:
        assert lab.add_host("x").ip == "10.99.7.11"
        assert lab.add_host("y").ip == "10.99.7.12"
        with pytest.raises(ValueError, match="already exists"):
            lab.add_host("x")
        with pytest.raises(ValueError, match="host name"):
            lab.add_host("sw")
    with pytest.raises(ValueError, match="private"):
        NetLab("8.8.8.0/24")


def test_available_reports_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netlab_available() == (False, "needs root (network namespaces)")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda t: None if t == "nft" else real_which(t))
    assert netlab_available() == (False, "nft not installed: apt-get install nftables")
