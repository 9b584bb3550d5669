"""Bounds on what a msgpack payload may expand into, shared by every wire format.

``max_array_len`` and ``max_map_len`` bound each container msgpack decodes, but not
how many there are: a one-byte ``{}`` becomes a whole Python dict, so a few MiB of
tiny containers could take gigabytes. :class:`ItemBudget` caps the total as the
payload decodes; :func:`count_items` counts it the same way before encoding, so a
sender never produces what a receiver would refuse. Standard library only: the
control sidecar uses it too and must not import hivemind or torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ItemBudget", "count_items"]


class ItemBudget:
    """Counts decoded array elements and map entries across a whole payload.

    Pass :meth:`list_hook` and :meth:`object_hook` to ``msgpack.unpackb``; msgpack
    calls them as each container completes, so decoding stops a payload of many
    small containers before it grows much past ``limit``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def _take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ValueError(f"more than {self.limit} items")

    def list_hook(self, items: list[Any]) -> list[Any]:
        self._take(len(items))
        return items

    def object_hook(self, mapping: dict[Any, Any]) -> dict[Any, Any]:
        # Empty maps cost a whole dict each, so they count as one item.
        self._take(max(len(mapping), 1))
        return mapping


def count_items(value: object) -> int:
    """Array elements plus map entries, counted the way :class:`ItemBudget` does."""
    if isinstance(value, dict):
        return max(len(value), 1) + sum(count_items(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return len(value) + sum(count_items(v) for v in value)
    return 0
