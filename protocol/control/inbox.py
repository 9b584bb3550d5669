"""What a control channel is handed: each message frame from its sidecar, checked again.

The sidecar is a separate process and is not trusted blindly: every message is
verified again with :func:`~protocol.control.frames.open_control`, must be signed by
the peer it came from, and is de-duplicated by ``(sender, seq)``, since a restarted
sidecar is sent recent history again. What passes goes to ``on_message``; what does
not is counted by reason and logged (the first few, then every thousandth).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from protocol.control.frames import ControlMessage, open_control
from protocol.control.settings import ChannelSettings
from protocol.control.tally import ChannelTally
from protocol.errors import ProtocolError

__all__ = ["Inbox", "OnMessage"]

logger = logging.getLogger(__name__)

OnMessage = Callable[[str, ControlMessage], None]
"""Called on the channel's thread with ``(topic, message)`` for each verified message."""

_SEEN_CAPACITY = 16384
_LOG_EVERY = 1000


class Inbox:
    """Checks the message frames of a channel's sidecar and hands on the new, valid ones.

    Args:
        settings: the channel's run, message cap and oldest message taken.
        topics: the topics the channel joined.
        on_message: takes each verified message from another node.
        tally: counts what arrives and what is refused.
    """

    def __init__(
        self,
        settings: ChannelSettings,
        topics: Sequence[str],
        on_message: OnMessage,
        tally: ChannelTally,
    ) -> None:
        self.settings = settings
        self._topics = tuple(topics)
        self._on_message = on_message
        self._tally = tally
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()

    def deliver(self, frame: dict[str, Any]) -> None:
        """Check a ``message`` frame and hand its message to ``on_message``."""
        topic, data, source = frame.get("topic"), frame.get("data"), frame.get("from")
        self._tally.traffic("received", data)
        if topic not in self._topics or not isinstance(data, bytes):
            self._drop("malformed", source, f"bad message frame on topic {topic!r}")
            return
        try:
            settings = self.settings
            message = open_control(
                data, settings.run, topic, settings.max_bytes, max_age_s=settings.max_age_s
            )
        except ProtocolError as e:
            self._drop(e.reason, source, e.detail)
            return
        if message.sender != source:
            self._drop("sender_mismatch", source, f"signed by {message.sender}")
            return
        if not self._first_sight(message):
            self._tally.drop("duplicate")
            return
        try:
            self._on_message(topic, message)
        except Exception:
            logger.exception(
                "on_message failed for %s #%d on %s", message.sender, message.seq, topic
            )

    def _first_sight(self, message: ControlMessage) -> bool:
        key = (message.sender, message.seq)
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > _SEEN_CAPACITY:
                self._seen.popitem(last=False)
            return True

    def _drop(self, reason: str, source: object, detail: str) -> None:
        count = self._tally.drop(reason)
        if count <= 10 or count % _LOG_EVERY == 0:
            logger.warning("refused control message from %s: %s: %s", source, reason, detail)
