"""The control sidecar: one py-libp2p GossipSub host per node, in its own process.

py-libp2p cannot be imported next to hivemind (both register the protobuf symbol
``crypto.pb.KeyType``), so the node starts this module as a child process
(``python -m protocol.control.sidecar``) and talks to it over its stdin and stdout with
the frames of :mod:`protocol.control.frames`. Logging goes to stderr only.

Node to sidecar::

    {"op": "start", "key_file": str, "listen_host": str, "port": int,
     "run": str, "topics": [str], "max_bytes": int}        # first frame, once
    {"op": "connect", "addrs": [multiaddr with /p2p/<id>]}
    {"op": "publish", "topic": str, "data": bytes}          # signed by the node
    {"op": "stats"}
    {"op": "stop"}

Sidecar to node::

    {"ev": "ready", "peer_id": str, "addrs": [str]}
    {"ev": "error", "error": str}                           # start failed; exits
    {"ev": "message", "topic": str, "data": bytes, "from": str}
    {"ev": "stats", "dropped": {reason: n}, "received": n, "published": n,
     "peers": [str], "topic_peers": {topic: [str]}, "mesh": {topic: n},
     "peer_addrs": {peer: [multiaddr]}}                     # every ~2 s, and on request
    {"ev": "log", "level": str, "msg": str}

Every message from the network passes a GossipSub topic validator before it is
delivered or forwarded: :func:`~protocol.control.frames.open_control` checks the
Atoll signature, run and topic, and the signed sender must be the libp2p source
of the message (whose own libp2p signature py-libp2p checks first), so a peer
can neither forge nor re-inject another peer's message. Messages this node
publishes are not checked here: the node signed them, and every receiver checks.

The sidecar exits when its stdin reaches end of file or ``stop`` arrives, and
when the node dies: it asks Linux for SIGKILL on the death of the thread that
started it (``PR_SET_PDEATHSIG``) and polls its parent pid as a fallback.


The GossipSub settings, peer scoring and py-libp2p workarounds live in
:mod:`protocol.control._gossip` (what 0.8.1 lets no instance set, in
:mod:`protocol.control._patch`), the pipe's two ends and the start frame's checks in
:mod:`protocol.control._pipe`; this module is the process: its lifecycle and main loop. Set ``ATOLL_SIDECAR_LOG=DEBUG`` in the node's environment for a
detailed log. This module imports neither hivemind nor torch, directly or
indirectly.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.tools.anyio_service import background_trio_service

from protocol.control._gossip import (
    GOSSIP,
    CountingPubsub,
    GossipSettings,
    PeerDialer,
    load_key_pair,
    new_gossip_host,
    new_router,
    peer_stats,
    quiet_libp2p_logs,
)
from protocol.control._patch import LIBP2P_DROPS, patch_libp2p
from protocol.control._pipe import FrameReader, PipeOut, StartConfig
from protocol.control.frames import open_control
from protocol.errors import ProtocolError
from protocol.p2p.watchdog import set_parent_death_signal

__all__ = ["GOSSIP", "GossipSettings", "main"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_PARENT_POLL_S = 0.5
_STOP_GRACE_S = 3.0
_LOG_EVERY = 1000  # after the first 10 of a kind, log one dropped message in this many


class _Sidecar:
    """One GossipSub host serving one node."""

    def __init__(self, config: StartConfig, key_pair: KeyPair, out: PipeOut) -> None:
        self.config = config
        self.out = out
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self.published = 0
        self.host = new_gossip_host(key_pair)
        self.my_id: ID = self.host.get_id()
        self.router = new_router()
        self.pubsub = CountingPubsub(self.host, self.router, strict_signing=True)
        self.dialer = PeerDialer(self.host, self._log)

    async def run(self, reader: FrameReader) -> None:
        """Serve until the node says stop or closes the pipe."""
        async with (
            self.host.run([self.config.listen_addr]),
            background_trio_service(self.pubsub),
            background_trio_service(self.router),
        ):
            await self.pubsub.wait_until_ready()
            subscriptions = {}
            for topic in self.config.topics:
                self.pubsub.set_topic_validator(topic, self._validator(topic), False)
                subscriptions[topic] = await self.pubsub.subscribe(topic)
            addrs = [str(a) for a in self.host.get_addrs()]
            logger.info("control sidecar %s listening on %s", self.my_id, addrs)
            self.out.emit({"ev": "ready", "peer_id": self.my_id.to_base58(), "addrs": addrs})
            async with trio.open_nursery() as nursery:
                for topic, subscription in subscriptions.items():
                    nursery.start_soon(self._deliver, topic, subscription)
                nursery.start_soon(self._report_stats_forever)
                self.dialer.start(nursery)
                await self._serve_commands(reader)
                # Shutdown must not hang on a peer: past the grace period, exit.
                _exit_after(_STOP_GRACE_S, 0)
                nursery.cancel_scope.cancel()

    def stats(self) -> dict[str, Any]:
        """The stats event: drop counts by reason, traffic and peers."""
        dropped = self.dropped + self.pubsub.drops + LIBP2P_DROPS
        if self.out.dropped:
            dropped["event_queue_full"] = self.out.dropped
        return {
            "ev": "stats",
            "dropped": dict(dropped),
            "received": self.received,
            "published": self.published,
            **peer_stats(self.host, self.pubsub, self.router, self.config.topics),
        }

    async def _serve_commands(self, reader: FrameReader) -> None:
        while True:
            frame = await reader.receive()
            if frame is None:
                logger.info("the node closed the pipe; stopping")
                return
            op = frame.get("op") if isinstance(frame, dict) else None
            if op == "stop":
                logger.info("stop requested")
                return
            try:
                await self._handle(op, frame)
            except Exception:  # one bad command must not take the host down
                logger.exception("command %r failed", op)
                self._log("error", f"command {op!r} failed; see the sidecar log")

    async def _handle(self, op: str | None, frame: dict[str, Any]) -> None:
        if op == "publish":
            await self._publish(frame.get("topic"), frame.get("data"))
        elif op == "connect":
            self.dialer.connect(frame.get("addrs"))
        elif op == "stats":
            self.out.emit(self.stats())
        else:
            self._log("warning", f"unknown op {op!r} ignored")

    async def _publish(self, topic: Any, data: Any) -> None:
        if topic not in self.config.topics or not isinstance(data, bytes):
            self.dropped["publish_rejected"] += 1
            self._log("warning", f"publish refused: unknown topic {topic!r} or data not bytes")
            return
        if len(data) > self.config.max_bytes:
            self.dropped["publish_oversized"] += 1
            self._log("warning", f"publish refused: {len(data)} bytes > {self.config.max_bytes}")
            return
        await self.pubsub.publish(topic, data)
        self.published += 1

    async def _report_stats_forever(self) -> None:
        while True:
            await trio.sleep(GOSSIP.stats_interval_s)
            try:
                self.out.emit(self.stats())
            except Exception:
                logger.exception("could not gather stats")

    async def _deliver(self, topic: str, subscription: Any) -> None:
        async for msg in subscription:
            source = ID(msg.from_id)
            if source == self.my_id:
                continue  # our own publish, looped back by py-libp2p
            self.received += 1
            self.out.emit(
                {"ev": "message", "topic": topic, "data": msg.data, "from": source.to_base58()}
            )

    def _validator(self, topic: str) -> Callable[[ID, rpc_pb2.Message], bool]:
        def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            # An exception escaping here would end the pubsub service.
            try:
                return self._validate(topic, forwarder, msg)
            except Exception:
                logger.exception("validator failed on a message from %s", forwarder)
                self.dropped["validator_error"] += 1
                return False

        return validate

    def _validate(self, topic: str, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        source = ID(msg.from_id)
        if source == self.my_id:
            return True
        try:
            message = open_control(msg.data, self.config.run, topic, self.config.max_bytes)
        except ProtocolError as e:
            self._note_drop(e.reason, source, forwarder, e.detail)
            return False
        if message.sender != source.to_base58():
            self._note_drop("sender_mismatch", source, forwarder, f"signed by {message.sender}")
            return False
        return True

    def _note_drop(self, reason: str, source: ID, forwarder: ID, detail: str) -> None:
        self.dropped[reason] += 1
        count = self.dropped[reason]
        level = logging.WARNING if count <= 10 or count % _LOG_EVERY == 0 else logging.DEBUG
        logger.log(
            level,
            "dropped control message #%d for %s: %s (source %s, via %s)",
            count,
            reason,
            detail,
            source,
            forwarder,
        )

    def _log(self, level: str, text: str) -> None:
        logger.log(logging.getLevelName(level.upper()), "%s", text)
        self.out.emit({"ev": "log", "level": level, "msg": text})


async def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            logger.warning("node %d is gone; exiting", parent_pid)
            os._exit(0)
        await trio.sleep(_PARENT_POLL_S)


async def _serve(reader: FrameReader, out: PipeOut) -> int:
    first = None
    with trio.move_on_after(_START_TIMEOUT_S):
        first = await reader.receive()
    if first is None:
        logger.error("no start frame within %.0f s", _START_TIMEOUT_S)
        return 1
    try:
        config = StartConfig.from_frame(first)
        key_pair = load_key_pair(config.key_file)
        sidecar = _Sidecar(config, key_pair, out)
    except Exception as e:  # bad config or key: tell the node why, then exit
        logger.error("cannot start: %s", e)
        await out.send({"ev": "error", "error": f"{type(e).__name__}: {e}"})
        return 2
    try:
        await sidecar.run(reader)
    except Exception as e:
        logger.exception("control sidecar failed")
        await out.send({"ev": "error", "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


async def _amain(parent_pid: int, out_fd: int) -> int:
    reader = FrameReader(trio.lowlevel.FdStream(os.dup(0)))
    out = PipeOut(trio.lowlevel.FdStream(out_fd), GOSSIP.event_queue)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(out.drain)
        nursery.start_soon(_watch_parent, parent_pid)
        code = await _serve(reader, out)
        nursery.cancel_scope.cancel()
    return code


def _exit_after(seconds: float, code: int) -> None:
    timer = threading.Timer(seconds, os._exit, (code,))
    timer.daemon = True
    timer.start()


def main() -> int:
    """Entry point of ``python -m protocol.control.sidecar``."""
    logging.basicConfig(
        level=os.environ.get("ATOLL_SIDECAR_LOG", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s sidecar[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    quiet_libp2p_logs()
    # Frames own the real stdout; anything else printed lands on stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    # The node ends this process; a Ctrl-C in its terminal must not do it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the node died before the request took effect
        return 0
    patch_libp2p(GOSSIP.outbound_queue, GOSSIP.subscription_queue)
    return trio.run(_amain, parent_pid, out_fd)


if __name__ == "__main__":
    exit_code = main()
    sys.stderr.flush()
    # py-libp2p may leave non-daemon threads behind; nothing is left to flush.
    os._exit(exit_code)
