"""The peers a restarted control sidecar dials again.

A new sidecar knows nobody: the channel keeps the addresses the node asked it to
connect to, and where connected peers listen (from the sidecar's stats), and has
the next sidecar dial them all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from protocol.control._process import remember

__all__ = ["Redial"]


class Redial:
    """Addresses to dial again after a restart. Thread-safe.

    Args:
        limit: how many connected peers' addresses are kept (the most recent).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._asked: list[str] = []
        self._listening: OrderedDict[str, list[str]] = OrderedDict()

    def asked(self, addrs: Iterable[str]) -> None:
        """The node asked to connect to ``addrs``."""
        with self._lock:
            self._asked.extend(a for a in addrs if a not in self._asked)

    def listening(self, peer_addrs: Any) -> None:
        """Where connected peers listen, as the sidecar reports (``{peer: [addr, ...]}``)."""
        with self._lock:
            remember(self._listening, peer_addrs, self.limit)

    def addresses(self) -> list[str]:
        """Every address to dial again, each once: those asked for first."""
        with self._lock:
            known = list(self._asked)
            known += [a for seen in self._listening.values() for a in seen if a not in known]
            return known
