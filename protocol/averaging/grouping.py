"""Who averages with whom in a round: pure, deterministic grouping rules (no network).

Every node that saw the same set of announced peers computes the same groups without
talking to anyone. Two layouts:

* ``random``: peers are ordered by ``sha256(round:fragment:peer)`` and cut into
  ``ceil(n / G)`` groups whose sizes differ by at most one (Moshpit SGD's random
  regrouping, Ryabinin et al., 2021): groups change every round, so contributions
  keep mixing across the swarm even as peers come and go.
* ``butterfly``: when ``n > G`` and ``n`` factors into radices no larger than ``G``
  (``8 = 2 x 2 x 2`` for ``G = 2``), peers sit on the points of a mixed-radix grid in
  an order that depends only on ``(fragment, peer)``, and round ``r`` groups the peers
  that differ only in digit ``r mod d``. After ``d`` consecutive rounds with the same
  peers, every peer's value has reached every other peer exactly once, so repeated
  group means give the exact global mean (a butterfly, or hypercube, all-reduce spread
  over rounds). When ``n`` has a prime factor above ``G`` the layout falls back to
  ``random``.

A group never leaves one peer alone when there are two or more peers: with ``G = 2``
and an odd count, one group has three members.

*Clients* (peers that announced they cannot be dialled, e.g. behind NAT) take part in
groups like everyone else but own no part (:func:`owners`): members send them nothing
they did not ask for. A group made only of clients could not exchange at all, so its
clients move to groups that have an owner, each to one chosen by
``sha256(client:round:fragment:peer)``; everyone computes the same move.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable
from typing import Literal

__all__ = ["Layout", "butterfly_radices", "form_groups", "group_of", "owners", "rounds_to_mix"]

Layout = Literal["random", "butterfly"]


def _rank(*fields: object) -> bytes:
    return hashlib.sha256(":".join(str(f) for f in fields).encode()).digest()


def butterfly_radices(n: int, group_size: int) -> list[int] | None:
    """The grid ``n`` peers sit on for groups of at most ``group_size``, or None.

    Greedy largest-divisor factorization: ``n = r_0 * r_1 * ...`` with every
    ``2 <= r_i <= group_size``. None when ``n <= group_size`` (one group is already
    everyone) or when ``n`` has a prime factor larger than ``group_size``.
    """
    if group_size < 2 or n <= group_size:
        return None
    radices, rest = [], n
    while rest > 1:
        radix = next((d for d in range(min(group_size, rest), 1, -1) if rest % d == 0), None)
        if radix is None:
            return None
        radices.append(radix)
        rest //= radix
    return radices


def rounds_to_mix(n: int, group_size: int) -> int | None:
    """Rounds of butterfly mixing after which ``n`` peers hold the exact global mean."""
    if n <= max(1, group_size):
        return 1
    radices = butterfly_radices(n, group_size)
    return len(radices) if radices else None


def form_groups(
    peers: Iterable[str],
    round_: int,
    fragment: int,
    group_size: int,
    layout: Layout = "random",
    clients: Collection[str] = frozenset(),
) -> list[list[str]]:
    """Split ``peers`` into groups of at most ``group_size``, deterministically.

    Within a group, members are ordered by ``sha256(round:fragment:peer)``, so which
    member reduces which part moves from round to round. Every group has at least one
    peer outside ``clients`` when ``peers`` has one (see the module docstring); a group
    that takes clients from elsewhere may then exceed ``group_size``.

    Raises:
        ValueError: ``group_size < 1`` or an unknown layout.
    """
    groups = _form_groups(peers, round_, fragment, group_size, layout)
    if not clients:
        return groups
    served = [g for g in groups if any(p not in clients for p in g)]
    orphans = [p for g in groups if g not in served for p in g]
    if not served or not orphans:
        return groups
    for peer in orphans:
        pick = int.from_bytes(_rank("client", round_, fragment, peer)[:8], "big") % len(served)
        served[pick].append(peer)
    return [sorted(g, key=lambda p: _rank(round_, fragment, p)) for g in served]


def owners(group: Iterable[str], clients: Collection[str]) -> list[str]:
    """The members of ``group`` that own a part: every one that is not a client, in order."""
    return [p for p in group if p not in clients]


def _form_groups(
    peers: Iterable[str], round_: int, fragment: int, group_size: int, layout: Layout
) -> list[list[str]]:
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if layout not in ("random", "butterfly"):
        raise ValueError(f"layout must be 'random' or 'butterfly', not {layout!r}")
    unique = sorted(set(peers))
    if not unique:
        return []
    radices = butterfly_radices(len(unique), group_size) if layout == "butterfly" else None
    if radices:
        return _butterfly(unique, round_, fragment, radices)
    ordered = sorted(unique, key=lambda p: _rank(round_, fragment, p))
    count = math.ceil(len(ordered) / group_size)
    if group_size >= 2 and len(ordered) >= 2 and len(ordered) // count < 2:
        count = len(ordered) // 2  # a lone peer would average with no one
    base, extra = divmod(len(ordered), count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(ordered[start : start + size])
        start += size
    return groups


def _butterfly(peers: list[str], round_: int, fragment: int, radices: list[int]) -> list[list[str]]:
    # Grid positions depend on the fragment only, never on the round: the same peers
    # keep the same coordinates while the axis moves, which is what makes the mix exact.
    placed = sorted(peers, key=lambda p: _rank("grid", fragment, p))
    axis = round_ % len(radices)
    stride = math.prod(radices[:axis])
    radix = radices[axis]
    groups = []
    for index in range(len(placed)):
        if (index // stride) % radix != 0:
            continue  # not the first point of its line along the axis
        line = [placed[index + k * stride] for k in range(radix)]
        groups.append(sorted(line, key=lambda p: _rank(round_, fragment, p)))
    return groups


def group_of(
    me: str,
    peers: Iterable[str],
    round_: int,
    fragment: int,
    group_size: int,
    layout: Layout = "random",
    clients: Collection[str] = frozenset(),
) -> list[str]:
    """The group ``me`` belongs to (``me`` is added to ``peers`` if missing)."""
    for group in form_groups({*peers, me}, round_, fragment, group_size, layout, clients):
        if me in group:
            return group
    raise AssertionError("unreachable: me is always in some group")
