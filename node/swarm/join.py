"""Run addresses: joining a run from one string that pins its operator.

``atoll spec create`` prints a run address for each bootstrap peer the operator runs
itself, ``RUN_ID@MULTIADDR``::

    demo@/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWOperator...

The multiaddr's PeerID is the operator's: the key that signed the run spec. A
volunteer runs ``atoll join ADDRESS``; :func:`fetch_spec` dials that peer alone (a
p2pd without a DHT), asks it for the run's spec (RPC ``atoll.spec``,
:mod:`protocol.runspec`), and keeps the spec only if it verifies and was signed by
that PeerID (or by ``--operator``, for an address through someone else's node). The
node then runs from the spec as ``atoll run --spec FILE --operator PEERID`` would.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from node.spec import RunSpec, SpecError, bootstrap_problem
from node.spec_file import parse_spec
from protocol.errors import ProtocolError
from protocol.p2p.config import TransportConfig
from protocol.runspec import fetch_spec_bytes
from verification.files import atomic_write
from verification.policy import is_peer_id

__all__ = ["RunAddress", "fetch_spec", "run_addresses", "save_spec"]

logger = logging.getLogger(__name__)

_EXAMPLE = "RUN_ID@/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


@dataclasses.dataclass(frozen=True)
class RunAddress:
    """A run and a peer to ask for its spec.

    Attributes:
        run_id: the run.
        maddr: the peer's multiaddr, ending in ``/p2p/<peer id>``.
    """

    run_id: str
    maddr: str

    @property
    def peer_id(self) -> str:
        """The PeerID the multiaddr names (by default, the operator's)."""
        return self.maddr.rsplit("/p2p/", 1)[1]

    def __str__(self) -> str:
        return f"{self.run_id}@{self.maddr}"

    @classmethod
    def parse(cls, text: str) -> RunAddress:
        """Read ``RUN_ID@MULTIADDR``.

        Raises:
            SpecError: one line saying what is wrong, with an example.
        """
        run_id, sep, maddr = text.strip().rpartition("@")
        if not sep or not run_id:
            raise SpecError(f"run address {text!r}: expected {_EXAMPLE}")
        if len(run_id) > 64:
            raise SpecError(f"run address {text!r}: a run id has at most 64 characters")
        if bootstrap_problem(maddr) is not None:
            _, sep, peer = maddr.rpartition("/p2p/")
            if sep and not is_peer_id(peer):
                raise SpecError(f"run address {text!r}: {peer!r} is not a PeerID (12D3KooW...)")
            raise SpecError(
                f"run address {text!r}: the part after @ must be a multiaddr ending in "
                f"/p2p/<PeerID>, as in {_EXAMPLE}"
            )
        return cls(run_id, maddr)


def run_addresses(spec: RunSpec) -> list[RunAddress]:
    """The run addresses of ``spec``: one per bootstrap peer that signed a version of it
    (its creator, or where the spec is a later version, the creator of one before it: an
    address pins the key it names, and a pin holds for the whole chain)."""
    signers = {version.creator for version in spec.chain()}
    return [
        RunAddress(spec.run_id, m) for m in spec.bootstrap if m.rpartition("/p2p/")[2] in signers
    ]


def fetch_spec(
    address: RunAddress,
    operator: str | None = None,
    *,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    wait: float = 0.0,
) -> tuple[RunSpec, bytes]:
    """Fetch the spec of ``address``'s run from its peer and verify it.

    Args:
        address: the run and the peer to ask.
        operator: the PeerID that must have signed the spec; None: the address's peer.
        host: the IP address this short-lived p2pd listens on (the node's
            ``network.host``).
        timeout: seconds for reaching the peer and for its answer, each.
        wait: how long to keep trying a peer that does not answer or does not serve
            the spec yet (a bootstrap node starting beside this one), in seconds.

    Returns:
        The verified spec and the bytes it came as (to write to a file).

    Raises:
        SpecError: the peer could not be reached or would not serve the spec (one line
            with the reason), or the spec it sent does not verify, is signed by another
            key than the operator's, or is for another run.
    """
    operator = operator or address.peer_id
    deadline = time.monotonic() + wait
    pause = 1.0
    while True:
        try:
            data = _ask(address, host, timeout)
            break
        except _NotYet as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                tried = f" (tried for {wait:.0f} s)" if wait > 0 else ""
                raise SpecError(f"run address {address}: {exc}{tried}") from None
            logger.warning(
                "run address %s: %s; trying again in %.0f s", address, exc, min(pause, left)
            )
            time.sleep(min(pause, left))
            pause = min(5.0, 2 * pause)
    spec = parse_spec(data, f"the run spec from {address.peer_id}", operator)
    if spec.run_id != address.run_id:
        raise SpecError(
            f"run address {address}: the peer served run {spec.run_id!r}, not {address.run_id!r}"
        )
    logger.info("fetched run %s's spec %s from %s", spec.run_id, spec.short, address.peer_id)
    return spec, data


class _NotYet(Exception):
    """The peer did not answer, or does not serve a spec yet: worth asking again."""


_TRY_AGAIN = frozenset({"unreachable", "no_handler", "timeout", "connection_lost", "busy"})


def _ask(address: RunAddress, host: str, timeout: float) -> bytes:
    """One try: a p2pd without a DHT dials the address's peer and asks it for the spec.

    Raises:
        _NotYet: the peer did not answer or serves no spec yet.
        SpecError: it refused (another run) or p2pd could not start.
    """
    from protocol.p2p.p2pd import BootstrapUnreachable
    from protocol.p2p.transport import Transport

    config = TransportConfig(
        host=host,
        initial_peers=(address.maddr,),
        request_timeout=timeout,
        startup_timeout=timeout,
        reachability="private",
        auto_nat=False,
        dht=False,
    )
    try:
        transport = Transport.start(config)
    except BootstrapUnreachable:
        raise _NotYet(
            f"{address.maddr} did not answer; check the address and that the node runs, "
            "with its port open to this host"
        ) from None
    except (RuntimeError, ValueError) as exc:
        raise SpecError(
            f"run address {address}: could not start p2pd to fetch the spec: {exc}"
        ) from None
    try:
        return transport.run(
            fetch_spec_bytes(transport, address.peer_id, address.run_id, timeout), timeout * 2
        )
    except ProtocolError as exc:
        if exc.reason in _TRY_AGAIN:
            raise _NotYet(f"the peer did not serve the run's spec ({exc})") from None
        raise SpecError(
            f"run address {address}: the peer did not serve the run's spec ({exc})"
        ) from None
    except TimeoutError:
        raise _NotYet(f"the peer did not answer within {timeout:.0f} s") from None
    finally:
        transport.shutdown()


def save_spec(data: bytes, path: Path) -> None:
    """Write fetched spec bytes to ``path`` (replacing an older copy), atomically.

    Raises:
        SpecError: it cannot be written.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, perms=0o644, replace=True)
    except OSError as exc:
        raise SpecError(f"run spec {path}: cannot write: {exc.strerror or exc}") from None
