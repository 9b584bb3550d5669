"""Bounds on what a msgpack payload may expand into, shared by every wire format.

``max_array_len`` and ``max_map_len`` bound each container msgpack decodes, but not
how many there are: a one-byte ``{}`` becomes a whole Python dict, so a few MiB of
tiny containers could take gigabytes. :class:`ItemBudget` caps the total as the
payload decodes; :func:`count_items` counts it the same way before encoding, so a
sender never produces what a receiver would refuse. :func:`bounded_unpackb` is the one
strict decode every wire format uses for untrusted bytes. msgpack and the standard
library only: the control sidecar uses it too and must not import hivemind or torch.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["ItemBudget", "bounded_unpackb", "count_items", "reject_ext"]


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


def reject_ext(code: int, data: bytes) -> Any:
    """``ext_hook`` that refuses extension types, so decoded values stay plain Python."""
    raise ValueError(f"msgpack extension type {code} is not allowed")


def bounded_unpackb(
    data: bytes, *, max_container: int, max_str_len: int, max_items: int | None = None
) -> Any:
    """Decode untrusted msgpack with every bound on: no extension types, string map
    keys only, at most ``max_container`` entries per array or map, strings of at most
    ``max_str_len`` bytes, binaries no longer than the input and, when given, at most
    ``max_items`` items in all (:class:`ItemBudget`).

    Raises ``ValueError`` with a one-line reason for every way the bytes can be bad
    (msgpack's own exceptions included), so callers turn one exception into one
    protocol error.
    """
    hooks: dict[str, Any] = {}
    if max_items is not None:
        budget = ItemBudget(max_items)
        hooks = {"list_hook": budget.list_hook, "object_hook": budget.object_hook}
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=reject_ext,
            max_bin_len=len(data),
            max_str_len=max_str_len,
            max_array_len=max_container,
            max_map_len=max_container,
            max_ext_len=0,
            **hooks,
        )
    except Exception as e:  # hostile bytes: every msgpack failure is one reason
        raise ValueError(f"{type(e).__name__}: {e}") from None
