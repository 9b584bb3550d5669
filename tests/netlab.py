"""A throwaway multi-host network on one machine, for integration tests and benchmarks.

Each host is a Linux network namespace with one veth to a bridge (the "switch"), which
lives in a namespace of its own, so a lab never touches the machine's interfaces or
routes. A NAT host sits behind a router namespace that masquerades its private network
and drops connections opened from the public side. Links can be rate-capped with tbf.

Namespace names embed the creating pid (``atl<pid>x<n>-<host>``), so ``cleanup_stale``
can remove what a crashed run left behind without touching a live one.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "atl"
_SWITCH = "br0"
_NAME = re.compile(r"[A-Za-z0-9_]{1,24}")
_RESERVED = {"sw", "probe"}
_TERM_GRACE_S = 3.0
_CMD_TIMEOUT_S = 15.0
# Why a forward filter: without it a public host that adds a route through the router
# would reach the inside host, which a real NAT does not allow.
_NAT_RULES = """
table ip atoll_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "eth0" ip saddr {inside} masquerade
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        ct state established,related accept
        iifname "eth0" oifname "in0" drop
    }}
}}
"""

_counter = itertools.count()
_open_labs: set[NetLab] = set()
_claimed: set[IPv4Network] = set()


class CommandError(subprocess.CalledProcessError):
    """A command the lab ran failed; the message names the command and its stderr."""

    def __str__(self) -> str:
        detail = (self.stderr or self.stdout or "").strip() or "no output"
        return f"command failed (exit {self.returncode}): {' '.join(map(str, self.cmd))}: {detail}"


@dataclass(frozen=True)
class Host:
    """One host of a lab.

    Attributes:
        name: logical name given by the test, e.g. ``"a"``.
        netns: the namespace the host's processes run in.
        ip: the host's own address.
        behind_nat: whether the host sits behind a NAT router.
        public_ip: the address peers see (``ip``, or the router's public address).
    """

    name: str
    netns: str
    ip: str
    behind_nat: bool
    public_ip: str


def _cmd(*argv: str, stdin: str | None = None) -> str:
    """Run one ``ip``/``tc``/``nft`` command; raise ``CommandError`` on any failure."""
    log.debug("netlab: %s", " ".join(argv))
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
    except FileNotFoundError as e:
        raise CommandError(127, list(argv), "", str(e)) from None
    except subprocess.TimeoutExpired:
        raise CommandError(-1, list(argv), "", f"timed out after {_CMD_TIMEOUT_S}s") from None
    if proc.returncode:
        raise CommandError(proc.returncode, list(argv), proc.stdout, proc.stderr)
    return proc.stdout


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _cmd("ip", "netns", "list").splitlines() if line.strip()]


def _root_networks() -> list[IPv4Network]:
    """IPv4 networks on the machine's own interfaces (root namespace)."""
    found = re.findall(r"\binet (\S+)", _cmd("ip", "-o", "-4", "addr", "show"))
    return [ipaddress.ip_interface(a).network for a in found]


def _pick_network(template: str, start: int, taken: list[IPv4Network]) -> IPv4Network:
    """The first ``template.format(n)`` /24, scanning from ``start``, that overlaps nothing."""
    for i in range(256):
        net = IPv4Network(template.format((start + i) % 256))
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"netlab: no free network of the form {template.format('N')}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _delete_netns(ns: str) -> None:
    """Kill whatever still runs in ``ns``, then delete it (its veths and nft tables go with it)."""
    for _ in range(20):  # a namespace with live processes would outlive its name
        pids = [int(p) for p in _cmd("ip", "netns", "pids", ns).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _cmd("ip", "netns", "delete", ns)


def netlab_available() -> tuple[bool, str]:
    """Whether a lab can be built here: ``(True, "")``, or ``(False, why not)``."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return False, f"{tool} not installed: apt-get install {package}"
    probe = f"{PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        _cmd("ip", "netns", "add", probe)
    except CommandError as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        _cmd("ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe")
    except CommandError as e:
        return False, f"nftables does not work here: {e}"
    finally:
        _delete_netns(probe)
    return True, ""


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces left by labs whose creating process is gone; return their names.

    A namespace whose pid is this process counts as stale only when no open lab owns it
    (a previous process with the same pid left it).
    """
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)x\d+-")
    owned = {ns for lab in _open_labs for ns in lab.namespaces}
    removed = []
    for ns in _list_netns():
        m = pattern.match(ns)
        if not m or ns in owned:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not _pid_alive(pid):
            _delete_netns(ns)
            removed.append(ns)
    if removed:
        log.info("netlab: removed stale namespaces %s", removed)
    return removed


class NetLab:
    """Hosts on one switch, some behind NAT, some rate-capped. Always ``close()`` it.

    Args:
        subnet: the public network, e.g. ``"10.77.3.0/24"``; by default a private /24
            not used by any interface of this machine (nor by another lab here).
    """

    def __init__(self, subnet: str | None = None) -> None:
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._links: dict[str, list[tuple[str, str]]] = {}  # host -> [(netns, dev)] to shape
        self._networks: list[IPv4Network] = []
        self._ports = itertools.count(1)
        self._closed = False
        self._creator = os.getpid()
        existing = _list_netns()
        for _ in range(1000):
            self.lab_id = f"{PREFIX}{os.getpid()}x{next(_counter)}"
            if not any(ns.startswith(f"{self.lab_id}-") for ns in existing):
                break
        _open_labs.add(self)
        try:
            self.subnet = self._claim(subnet, "10.77.{}.0/24")
            self._addresses = iter(list(self.subnet.hosts())[10:])  # .11 onward
            self._switch = self._add_netns("sw")
            _cmd("ip", "-n", self._switch, "link", "add", _SWITCH, "type", "bridge")
            _cmd("ip", "-n", self._switch, "link", "set", _SWITCH, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this lab created and has not deleted yet."""
        return tuple(self._namespaces)

    def add_host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A host on the switch with an address from the lab subnet."""
        ns = self._new_host_netns(name)
        ip, port = self._plug(ns)
        host = Host(name, ns, ip, behind_nat=False, public_ip=ip)
        return self._register(host, [(ns, "eth0"), (self._switch, port)], rate_mbit)

    def add_nat_host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A host on a private /24 behind its own masquerading router.

        The host can open connections to public hosts, which see them coming from the
        router's public address; nothing public can open a connection to the host.
        """
        ns = self._new_host_netns(name)
        router = self._add_netns(f"{name}-nat")
        public, _ = self._plug(router)
        inside = self._claim(None, "192.168.{}.0/24")
        gateway, ip = (str(a) for a in itertools.islice(inside.hosts(), 2))
        _cmd("ip", "-n", router, "link", "add", "in0", "type", "veth", "peer", "eth0", "netns", ns)
        _cmd("ip", "-n", router, "addr", "add", f"{gateway}/{inside.prefixlen}", "dev", "in0")
        _cmd("ip", "-n", router, "link", "set", "in0", "up")
        _cmd("ip", "-n", ns, "addr", "add", f"{ip}/{inside.prefixlen}", "dev", "eth0")
        _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
        _cmd("ip", "-n", ns, "route", "add", "default", "via", gateway)
        _cmd("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = _NAT_RULES.format(inside=inside)
        _cmd("ip", "netns", "exec", router, "nft", "-f", "-", stdin=rules)
        host = Host(name, ns, ip, behind_nat=True, public_ip=public)
        return self._register(host, [(ns, "eth0"), (router, "in0")], rate_mbit)

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Cap ``host``'s link at ``rate_mbit`` both ways (its inside link, behind NAT).

        tbf on the host's veth shapes its egress; tbf on the far end's egress shapes its
        ingress. Burst is 4 ms of traffic (at least 4000 bytes, so a full frame fits).
        """
        if not rate_mbit > 0:
            raise ValueError(f"netlab: rate_mbit must be positive, got {rate_mbit}")
        rate_bit = int(rate_mbit * 1e6)
        burst = max(4000, rate_bit // 2000)
        for ns, dev in self._links_of(host):
            _cmd(
                "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{rate_bit}bit", "burst", str(burst), "latency", "50ms",
            )  # fmt: skip

    def set_link(self, host: Host, up: bool) -> None:
        """Pull ``host``'s cable, or plug it back: its link's far end goes down or up, so
        the host keeps its address and routes and its packets go nowhere meanwhile."""
        ns, dev = self._links_of(host)[-1]
        _cmd("ip", "-n", ns, "link", "set", dev, "up" if up else "down")

    def unshape(self, host: Host) -> None:
        """Remove a cap set by ``shape``."""
        for ns, dev in self._links_of(host):
            with contextlib.suppress(CommandError):  # not shaped: nothing to delete
                _cmd("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")

    def popen(self, host: Host, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in its own process group.

        The environment passes through. ``close()`` kills the whole group.
        """
        self._check_host(host)
        kwargs["start_new_session"] = True
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: Host, argv: list[str], timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside ``host``'s namespace and capture its output.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (its group is killed).
            CommandError: ``check`` and it exited non-zero.
        """
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _kill_group(proc, signal.SIGKILL)  # also any child it left running
            if proc.poll() is None:
                proc.communicate()
            self._procs.remove(proc)
        if check and proc.returncode:
            raise CommandError(proc.returncode, proc.args, out, err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        """Kill every process the lab started and delete everything it made. Idempotent."""
        if self._closed:
            return
        errors = []
        self._stop_processes()
        for ns in reversed(self._namespaces):
            try:
                if ns in _list_netns():  # someone may have deleted it already
                    _delete_netns(ns)
                self._namespaces.remove(ns)
            except CommandError as e:
                errors.append(str(e))
        _claimed.difference_update(self._networks)
        self._closed = True
        _open_labs.discard(self)
        if errors:
            raise RuntimeError("netlab: cleanup incomplete: " + "; ".join(errors))

    # -- building blocks --------------------------------------------------------------

    def _claim(self, subnet: str | None, template: str) -> IPv4Network:
        if subnet is None:
            taken = [*_root_networks(), *_claimed]
            net = _pick_network(template, os.getpid() + len(_claimed), taken)
        else:
            net = IPv4Network(subnet)
            if not net.is_private or net.num_addresses < 32:
                raise ValueError(f"netlab: subnet {subnet} must be private with >= 32 addresses")
        _claimed.add(net)
        self._networks.append(net)
        return net

    def _add_netns(self, suffix: str) -> str:
        if self._closed:
            raise RuntimeError("netlab: lab is closed")
        ns = f"{self.lab_id}-{suffix}"
        _cmd("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _new_host_netns(self, name: str) -> str:
        if not _NAME.fullmatch(name) or name in _RESERVED:
            raise ValueError(
                f"netlab: host name {name!r}: expected 1-24 of [A-Za-z0-9_], not sw or probe"
            )
        if name in self.hosts:
            raise ValueError(f"netlab: host {name!r} already exists")
        return self._add_netns(name)

    def _plug(self, ns: str) -> tuple[str, str]:
        """Connect ``ns``'s ``eth0`` to the switch; return its address and the switch port."""
        ip = next(self._addresses, None)
        if ip is None:
            raise RuntimeError(f"netlab: subnet {self.subnet} has no addresses left")
        port = f"p{next(self._ports)}"
        _cmd(
            "ip",
            "-n",
            self._switch,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "eth0",
            "netns",
            ns,
        )
        _cmd("ip", "-n", self._switch, "link", "set", port, "master", _SWITCH, "up")
        _cmd("ip", "-n", ns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
        return str(ip), port

    def _register(self, host: Host, links: list[tuple[str, str]], rate: float | None) -> Host:
        self._links[host.name] = links
        self.hosts[host.name] = host
        if rate is not None:
            self.shape(host, rate)
        return host

    def _check_host(self, host: Host) -> None:
        if self.hosts.get(host.name) != host or self._closed:
            raise ValueError(f"netlab: {host.name!r} is not a host of open lab {self.lab_id}")

    def _links_of(self, host: Host) -> list[tuple[str, str]]:
        self._check_host(host)
        return self._links[host.name]

    def _stop_processes(self) -> None:
        """SIGTERM each live group, wait a few seconds, then SIGKILL those groups and reap.

        Only groups whose leader is alive now are signalled (an exited leader's pid may
        belong to someone else by now); ``_delete_netns`` kills anything else still inside.
        """
        live = [proc for proc in self._procs if proc.poll() is None]
        for proc in live:
            _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_GRACE_S
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in live:
            _kill_group(proc, signal.SIGKILL)  # children that outlived their leader too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_TERM_GRACE_S)
        self._procs.clear()


def _close_all() -> None:
    for lab in [lab for lab in _open_labs if lab._creator == os.getpid()]:  # not a fork's
        try:
            lab.close()
        except Exception:  # at exit, keep closing the others
            log.exception("netlab: cleanup of %s failed", lab.lab_id)


atexit.register(_close_all)
