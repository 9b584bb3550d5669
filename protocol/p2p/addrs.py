"""Multiaddrs a node may tell other hosts about, and the parts of one it needs.

A node that listens on a wildcard address (``0.0.0.0``) is reported by p2pd and
py-libp2p at every address of every interface, loopback included. A peer on another
host that dials ``127.0.0.1`` reaches its own machine, never this node, so loopback
addresses are published only by nodes that listen on loopback themselves (a local
swarm). This module imports nothing heavier than :mod:`psutil`, so the control
sidecar can use it too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

import psutil

__all__ = [
    "expand_wildcard",
    "host_of",
    "interface_addresses",
    "is_loopback",
    "is_wildcard",
    "peer_ids",
    "publishable",
    "tcp_maddr",
    "tcp_port",
    "with_peer_id",
]


def _parts(maddr: str) -> list[str]:
    return maddr.strip("/").split("/")


def host_of(maddr: str) -> str | None:
    """The IP address in an ``/ip4/...`` or ``/ip6/...`` multiaddr, or None (DNS, relay)."""
    parts = _parts(maddr)
    for proto in ("ip4", "ip6"):
        if proto in parts:
            i = parts.index(proto)
            if i + 1 < len(parts):
                return parts[i + 1]
    return None


def tcp_port(maddr: str) -> int | None:
    """The TCP port of a multiaddr, or None."""
    parts = _parts(maddr)
    if "tcp" in parts:
        i = parts.index("tcp")
        try:
            return int(parts[i + 1])
        except (IndexError, ValueError):
            return None
    return None


def is_loopback(maddr: str) -> bool:
    """Whether a multiaddr points at this machine's loopback (``127.0.0.0/8``, ``::1``)."""
    host = host_of(maddr)
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (``0.0.0.0`` or ``::``)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def tcp_maddr(host: str, port: int) -> str:
    """``/ip4/HOST/tcp/PORT`` (or ``/ip6/...``)."""
    family = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    return f"/{family}/{host}/tcp/{port}"


def peer_ids(maddrs: Iterable[str]) -> list[str]:
    """The PeerIDs named by ``/p2p/<id>`` multiaddrs, in order, once each (others are skipped)."""
    return list(dict.fromkeys(m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m))


def with_peer_id(maddr: str, peer_id: str) -> str:
    """``maddr`` ending in ``/p2p/<peer_id>`` (added when missing)."""
    if "/p2p/" in maddr:
        return maddr
    return f"{maddr.rstrip('/')}/p2p/{peer_id}"


def interface_addresses(include_loopback: bool = False, ipv6: bool = False) -> list[str]:
    """This host's interface IP addresses (IPv4 unless ``ipv6``), sorted."""
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a.address.split("%", 1)[0])
            except ValueError:
                continue  # a link-layer address
            if ip.version == 6 and (not ipv6 or ip.is_link_local):
                continue
            if ip.is_loopback and not include_loopback:
                continue
            out.add(str(ip))
    return sorted(out)


def publishable(maddrs: Iterable[str], listen_host: str) -> list[str]:
    """The addresses of ``maddrs`` that peers on other hosts can use.

    Loopback addresses are kept only when the node itself listens on loopback (a
    swarm on one machine); wildcard addresses are never kept. Order and duplicates
    are preserved and dropped respectively.
    """
    try:
        local_only = ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        local_only = False
    out: list[str] = []
    for m in maddrs:
        host = host_of(m)
        if host is not None and is_wildcard(host):
            continue
        if is_loopback(m) and not local_only:
            continue
        if m not in out:
            out.append(m)
    return out


def expand_wildcard(maddrs: Sequence[str]) -> list[str]:
    """Replace wildcard hosts in ``maddrs`` by this machine's interface addresses."""
    out: list[str] = []
    for m in maddrs:
        host = host_of(m)
        if host is None or not is_wildcard(host):
            out.append(m)
            continue
        v6 = ipaddress.ip_address(host).version == 6
        for ip in interface_addresses(include_loopback=True, ipv6=v6):
            if (ipaddress.ip_address(ip).version == 6) == v6:
                out.append(m.replace(f"/{host}/", f"/{ip}/", 1))
    return out
