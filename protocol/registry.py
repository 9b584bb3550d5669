"""The peer registry: each node's signed record of itself in the DHT, and reading
everyone's.

A node keeps a registry record under ``{run_id}:nodes`` (round, multiaddrs,
step) refreshed every few seconds; it tells a joining node whom to catch up from
and tells everyone which peers are alive and should be waited for. Every node reads
every record, so the few DHT nodes that store one key would serve the whole swarm's
records to the whole swarm; with ``network.registry_shards = S > 1`` the registry is
``S`` keys, ``{run_id}:nodes:{S}:{i}``, a record under shard ``i =``
:func:`registry_shard` of its PeerID, and a read fetches the ``S`` keys at once, so
each key's holders serve ``1/S`` of the records.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from protocol.wire.messages import Header, open_envelope, seal
from verification.identity import Identity

__all__ = ["PeerRecord", "publish_record", "read_registry", "registry_shard"]

logger = logging.getLogger(__name__)

_MAX_RECORD_BYTES = 16 * 1024


@dataclass(frozen=True)
class PeerRecord:
    """A node as its signed registry record describes it.

    Attributes:
        peer: its PeerID.
        round: the last round it finished.
        step: its inner step count.
        maddrs: where its p2pd listens (as it publishes them).
        updated: its wall-clock time when it wrote the record.
        control: multiaddrs of its control sidecar (GossipSub), if it runs one.
        reachable: whether others can dial it (see :mod:`protocol.p2p.reachability`).
        spec: digest of the run spec (or shared settings) it runs.
        instance: a random id of the running process: two processes with one key
            write different ones.
        started: wall-clock time its process started.
    """

    peer: str
    round: int
    step: int
    maddrs: tuple[str, ...]
    updated: float
    control: tuple[str, ...] = ()
    reachable: bool = True
    spec: str = ""
    instance: str = ""
    started: float = 0.0


def registry_shard(peer_id: str, shards: int) -> int:
    """The shard of a registry of ``shards`` keys that holds ``peer_id``'s record."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    digest = hashlib.sha256(b"atoll/registry\0" + peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


def _registry_key(run_id: str, shard: int = 0, shards: int = 1) -> str:
    return f"{run_id}:nodes" if shards == 1 else f"{run_id}:nodes:{shards}:{shard}"


async def publish_record(
    transport: Transport,
    identity: Identity,
    run_id: str,
    record: PeerRecord,
    *,
    expiration: float,
    timeout: float,
    shards: int = 1,
) -> bool:
    """Store this node's signed registry record (``record.peer`` must be this node) in
    its shard of a registry of ``shards`` keys."""
    if record.peer != identity.peer_id:
        raise ValueError("a node publishes only its own registry record")
    header = Header("record", run_id, record.round, 0, 0, identity.peer_id)
    body = {
        "step": int(record.step),
        "maddrs": list(record.maddrs),
        "time": record.updated,
        "control": list(record.control),
        "reachable": bool(record.reachable),
        "spec": record.spec,
        "instance": record.instance,
        "started": float(record.started),
    }
    value = seal(identity, header, body)
    key = _registry_key(run_id, registry_shard(identity.peer_id, shards), shards)
    return await transport.dht_store(
        key, identity.peer_id, value, expiration, timeout=timeout, kind="registry"
    )


def _str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(m, str) for m in value)


def _record(subkey: str, value: bytes, run_id: str) -> PeerRecord:
    """A registry entry, checked; ProtocolError when anything is off."""
    env = open_envelope(
        value,
        max_bytes=_MAX_RECORD_BYTES,
        expected_sender=subkey,
        run_id=run_id,
        kinds=("record",),
    )
    body = env.body
    maddrs, control = body.get("maddrs"), body.get("control", [])
    step, updated = body.get("step"), body.get("time")
    reachable, spec = body.get("reachable", True), body.get("spec", "")
    instance, started = body.get("instance", ""), body.get("started", 0.0)
    if not (
        _str_list(maddrs)
        and _str_list(control)
        and isinstance(step, int)
        and isinstance(updated, (int, float))
        and isinstance(reachable, bool)
        and isinstance(spec, str)
        and isinstance(instance, str)
        and isinstance(started, (int, float))
    ):
        raise ProtocolError("malformed", "registry record fields")
    return PeerRecord(
        peer=subkey,
        round=env.header.round,
        step=step,
        maddrs=tuple(maddrs),
        updated=float(updated),
        control=tuple(control),
        reachable=reachable,
        spec=spec,
        instance=instance,
        started=float(started),
    )


async def read_registry(
    transport: Transport,
    run_id: str,
    *,
    timeout: float,
    shards: int = 1,
    previous: Mapping[str, PeerRecord] | None = None,
) -> dict[str, PeerRecord]:
    """Every node of the run, from their signed registry records (stale ones included).

    The ``shards`` keys are read at once. A record found under a shard other than its
    PeerID's is dropped. For a shard whose read failed the records of ``previous``
    (an earlier read) from that shard are kept, so one slow DHT lookup does not make
    a part of the swarm look gone.

    Raises:
        ProtocolError: every shard's read failed (the first one's error).
        ValueError: ``shards < 1``.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    found = await asyncio.gather(
        *(
            transport.dht_get(_registry_key(run_id, i, shards), timeout=timeout, kind="registry")
            for i in range(shards)
        ),
        return_exceptions=True,
    )
    failed = {i for i, got in enumerate(found) if isinstance(got, BaseException)}
    for got in found:
        if isinstance(got, BaseException) and not isinstance(got, ProtocolError):
            raise got
    if failed and len(failed) == shards:
        raise next(got for got in found if isinstance(got, ProtocolError))
    out: dict[str, PeerRecord] = {}
    for shard, items in enumerate(found):
        if not isinstance(items, dict):
            continue
        for subkey, value in items.items():
            if shards > 1 and registry_shard(subkey, shards) != shard:
                logger.info(
                    "registry record of %s under shard %d refused: not its shard",
                    subkey[:16],
                    shard,
                )
                continue
            try:
                out[subkey] = _record(subkey, value, run_id)
            except ProtocolError as exc:
                logger.info("registry record under %s rejected: %s", subkey[:16], exc)
    for peer, record in (previous or {}).items():
        if peer not in out and registry_shard(peer, shards) in failed:
            out[peer] = record
    return out
