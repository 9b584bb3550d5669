"""The one process-wide change the control sidecar makes to py-libp2p 0.8.1.

Some of what the sidecar needs, py-libp2p 0.8.1 lets no instance set: ``Pubsub`` takes
no size for each peer's outbound queue (it builds ``RpcQueue()``, 32 RPCs) nor for each
subscription's channel (the module global ``SUBSCRIPTION_CHANNEL_SIZE``, 32), drops
on overflow through the module function ``drop_rpc`` with only a debug log, and issues
and checks the signed peer record every RPC carries through the module functions
``env_to_send_in_RPC`` and ``maybe_consume_signed_record``, imported by name into its
``pubsub`` and ``gossipsub`` modules. :func:`patch_libp2p` replaces those globals, once,
in the sidecar's own process (nothing else there uses py-libp2p); everything that can be
set on an instance is set there instead (:mod:`protocol.control._gossip`).
"""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict
from typing import Any

from libp2p.abc import IHost
from libp2p.peer import peerstore as _peerstore_module
from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as _gossipsub_module
from libp2p.pubsub import pubsub as _pubsub_module
from libp2p.pubsub import utils as _pubsub_utils
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import RpcQueue

__all__ = ["LIBP2P_DROPS", "patch_libp2p"]

LIBP2P_DROPS: Counter[str] = Counter()
"""Outbound RPCs py-libp2p dropped, by reason (counted by the patched ``drop_rpc``)."""

_RECORDS_KEPT = 4096
_RECORD_RECHECK_S = 600.0  # well inside the 2 h the peerstore keeps a record
_OWN_RECORD_S = 10.0  # how long this node's own record is sent before its addresses are read again
_own_records: dict[int, tuple[float, frozenset[str], bytes]] = {}
_consumed: OrderedDict[tuple[ID, bytes], float] = OrderedDict()
_patched = False


def patch_libp2p(outbound_queue: int, subscription_queue: int) -> None:
    """Size py-libp2p's queues, count its silent drops, and check each peer record once.

    Each peer's outbound queue holds ``outbound_queue`` RPCs and each subscription's
    channel ``subscription_queue`` messages; a dropped RPC is counted in
    :data:`LIBP2P_DROPS`. The signed peer record every RPC carries is issued and checked
    once, not per RPC, and yamux returns receive window as go-yamux does (once half of
    it is read) rather than with one WINDOW_UPDATE frame per read, which doubled the
    frames a sidecar encrypts and writes. A second call changes nothing.
    """
    global _patched
    if _patched:
        return
    _patched = True
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    original_drop_rpc = _pubsub_module.drop_rpc

    def counting_drop_rpc(peer_id: ID, rpc: rpc_pb2.RPC) -> None:
        LIBP2P_DROPS["outbound_queue_full" if rpc.publish else "outbound_control_dropped"] += 1
        original_drop_rpc(peer_id, rpc)

    class SizedRpcQueue(RpcQueue):
        def __init__(self, max_size: int = outbound_queue, **kwargs: Any) -> None:
            super().__init__(max_size, **kwargs)

    _pubsub_module.RpcQueue = SizedRpcQueue
    _pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = subscription_queue
    _pubsub_module.drop_rpc = counting_drop_rpc
    _gossipsub_module.drop_rpc = counting_drop_rpc
    # Every RPC carries the sender's signed peer record: py-libp2p re-parses its own
    # record to send it and checks the signature of each one it receives, twice
    # (pubsub and router). The same bytes from the same peer need one check.
    for module in (_pubsub_module, _gossipsub_module):
        module.env_to_send_in_RPC = _own_record
        module.maybe_consume_signed_record = _consume_record_once


def _own_record(host: IHost) -> tuple[bytes, bool]:
    """py-libp2p's ``env_to_send_in_RPC``, issued once per set of listen addresses
    (which are read again every :data:`_OWN_RECORD_S`)."""
    now = time.monotonic()
    cached = _own_records.get(id(host))
    if cached is not None and now - cached[0] < _OWN_RECORD_S:
        return cached[2], False
    addrs = frozenset(str(a) for a in host.get_addrs())
    if cached is not None and cached[1] == addrs:
        _own_records[id(host)] = (now, addrs, cached[2])
        return cached[2], False
    envelope, issued = _peerstore_module.env_to_send_in_RPC(host)
    _own_records[id(host)] = (now, addrs, envelope)
    return envelope, issued


def _consume_record_once(msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
    """py-libp2p's ``maybe_consume_signed_record``, once per peer and record bytes
    (again after :data:`_RECORD_RECHECK_S`, which renews the peerstore entry)."""
    if not msg.HasField("senderRecord"):
        return True
    key = (peer_id, bytes(msg.senderRecord))
    checked = _consumed.get(key)
    if checked is not None and time.monotonic() - checked < _RECORD_RECHECK_S:
        return True
    ok = _pubsub_utils.maybe_consume_signed_record(msg, host, peer_id)
    if ok:
        _consumed[key] = time.monotonic()
        _consumed.move_to_end(key)
        while len(_consumed) > _RECORDS_KEPT:
            _consumed.popitem(last=False)
    return ok
