"""Who averages with whom in a round: pure, deterministic grouping rules (no network).

Every node that saw the same set of announced peers computes the same groups without
talking to anyone. Two layouts:

* ``random``: peers are ordered by ``sha256(round:peer)`` and cut into
  ``ceil(n / G)`` groups whose sizes differ by at most one (Moshpit SGD's random
  regrouping, Ryabinin et al., 2021): groups change every round, so contributions
  keep mixing across the swarm even as peers come and go.
* ``butterfly``: when ``n > G`` and ``n`` factors into radices no larger than ``G``
  (``8 = 2 x 2 x 2`` for ``G = 2``), peers sit on the points of a mixed-radix grid in
  an order that depends only on the peer, and round ``r`` groups the peers
  that differ only in digit ``r mod d``. After ``d`` consecutive rounds with the same
  peers, every peer's value has reached every other peer exactly once, so repeated
  group means give the exact global mean (a butterfly, or hypercube, all-reduce spread
  over rounds). When ``n`` has a prime factor above ``G`` the layout falls back to
  ``random``.

Who is in which group depends on the round and the announced peers, never on the
fragment: every fragment of a round is exchanged in the same groups, so the members of a
group hold the same values of every fragment before the round's outer steps (the base
useful-work checks measure on, :mod:`verification.usefulness`). The fragment only orders
a group's members (``sha256(round:fragment:peer)``), so which member owns which part
still moves from fragment to fragment.

A group never leaves one peer alone when there are two or more peers: with ``G = 2``
and an odd count, one group has three members.

*Clients* (peers that announced they cannot be dialled, e.g. behind NAT) take part in
groups like everyone else but own no part (:func:`owners`): members send them nothing
they did not ask for. A group made only of clients could not exchange at all, so its
clients move to groups that have an owner, each to one chosen by
``sha256(client:round:peer)``; everyone computes the same move.

Both layouts need every announced peer. In a swarm too large for every node to read
every announcement, peers are instead placed on a *cell grid* (:class:`Cell`, Moshpit
SGD's grid): each peer's coordinates come from ``sha256(cell:cycle:peer)``, in
``dims`` digits of base ``G``, and round ``r`` averages the peers that agree on every
digit but digit ``r mod dims`` (a line of the grid), so a node needs only its own
line's announcements. The grid is drawn anew every ``dims`` rounds (``cycle = r //
dims``): within a cycle a peer keeps its point while the axis moves, and the next
cycle scatters the peers one cycle reached across fresh lines. ``dims`` is the largest
with ``2 G^dims <= n``, so a line holds ``2G`` to ``2G^2`` peers on average, and lines
are dealt into groups of at most ``G`` across the axis. The mix is not exact (peers
fall on the grid unevenly, and two peers of one cell never share a group), unlike the
full-grid butterfly; see :func:`cell_groups`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Cell",
    "Layout",
    "butterfly_radices",
    "cell_dims",
    "cell_groups",
    "form_groups",
    "group_of",
    "owners",
    "rounds_to_mix",
]

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
    return _serve_clients(
        _form_groups(peers, round_, fragment, group_size, layout), round_, fragment, clients
    )


def _serve_clients(
    groups: list[list[str]], round_: int, fragment: int, clients: Collection[str]
) -> list[list[str]]:
    """Move the clients of groups made only of clients into groups with an owner."""
    if not clients:
        return groups
    served = [g for g in groups if any(p not in clients for p in g)]
    orphans = [p for g in groups if g not in served for p in g]
    if not served or not orphans:
        return groups
    for peer in orphans:
        pick = int.from_bytes(_rank("client", round_, peer)[:8], "big") % len(served)
        served[pick].append(peer)
    return [_in_order(g, round_, fragment) for g in served]


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
    ordered = sorted(unique, key=lambda p: _rank(round_, p))
    count = _group_count(len(ordered), group_size)
    base, extra = divmod(len(ordered), count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(_in_order(ordered[start : start + size], round_, fragment))
        start += size
    return groups


def _in_order(members: list[str], round_: int, fragment: int) -> list[str]:
    """A group's members in the order that gives out its parts (moves per fragment)."""
    return sorted(members, key=lambda p: _rank(round_, fragment, p))


def _group_count(n: int, group_size: int) -> int:
    """Groups for ``n`` peers (``n >= 1``) in groups of at most ``group_size``, never
    leaving one peer alone when there are two or more."""
    count = math.ceil(n / group_size)
    if group_size >= 2 and n >= 2 and n // count < 2:
        count = n // 2  # a lone peer would average with no one
    return count


def _butterfly(peers: list[str], round_: int, fragment: int, radices: list[int]) -> list[list[str]]:
    # Grid positions depend on the peer only, never on the round: the same peers keep
    # the same coordinates while the axis moves, which is what makes the mix exact.
    placed = sorted(peers, key=lambda p: _rank("grid", p))
    axis = round_ % len(radices)
    stride = math.prod(radices[:axis])
    radix = radices[axis]
    groups = []
    for index in range(len(placed)):
        if (index // stride) % radix != 0:
            continue  # not the first point of its line along the axis
        line = [placed[index + k * stride] for k in range(radix)]
        groups.append(_in_order(line, round_, fragment))
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


def cell_dims(n: int, group_size: int) -> int:
    """Axes of the cell grid for a swarm of ``n``: the largest ``d >= 1`` with
    ``2 * group_size ** d <= n`` (a line then holds ``2G`` to ``2G^2`` peers on average)."""
    if group_size < 2:
        raise ValueError("group_size must be >= 2 for a cell grid")
    dims = 1
    while 2 * group_size ** (dims + 1) <= n:
        dims += 1
    return dims


def _coords(peer: str, group_size: int, dims: int, cycle: int) -> tuple[int, ...]:
    # From the peer and the cycle of ``dims`` rounds, never the round itself (the same
    # peer keeps its point while the axis moves, so in a cycle its value travels along
    # every axis) nor the fragment (every fragment of a round is exchanged on the same
    # line). A new cycle draws a new grid: two peers of one cell never share a group, and
    # on a grid kept for good each would reach the other's cell only through third peers
    # (at 10,000 nodes 98.5 % of contributions reached every node in log_G n + 2 rounds
    # on a fixed grid, ``python -m benchmarks churn``).
    value = int.from_bytes(_rank("cell", cycle, peer), "big")
    digits = []
    for _ in range(dims):
        value, digit = divmod(value, group_size)
        digits.append(digit)
    return tuple(digits)


@dataclass(frozen=True)
class Cell:
    """The line of the cell grid that a peer averages along in one round.

    Attributes:
        fragment: the fragment exchanged along it (every fragment of a round uses the
            same grid and lines).
        group_size: the grid's base ``G``.
        dims: the grid's axes (:func:`cell_dims` of the swarm size).
        cycle: which grid (``round // dims``): one per ``dims`` rounds.
        axis: the digit that varies along the line (``round mod dims``).
        coords: the line's other digits (the one on ``axis`` is None).
    """

    fragment: int
    group_size: int
    dims: int
    cycle: int
    axis: int
    coords: tuple[int | None, ...]

    @classmethod
    def of(cls, peer: str, round_: int, fragment: int, group_size: int, n: int) -> Cell:
        """``peer``'s line in round ``round_`` of a swarm of about ``n`` peers."""
        dims = cell_dims(n, group_size)
        cycle, axis = divmod(round_, dims)
        digits = _coords(peer, group_size, dims, cycle)
        coords = tuple(None if i == axis else d for i, d in enumerate(digits))
        return cls(fragment, group_size, dims, cycle, axis, coords)

    @property
    def key(self) -> str:
        """A name for the line, the same for every peer on it (and the grid's shape)."""
        digits = ".".join("*" if c is None else str(c) for c in self.coords)
        return f"g{self.group_size}d{self.dims}:{digits}"

    def holds(self, peer: str) -> bool:
        """Whether ``peer`` sits on this line."""
        digits = _coords(peer, self.group_size, self.dims, self.cycle)
        return all(c is None or c == d for c, d in zip(self.coords, digits, strict=True))


def cell_groups(
    peers: Iterable[str],
    round_: int,
    fragment: int,
    group_size: int,
    n: int,
    clients: Collection[str] = frozenset(),
) -> list[list[str]]:
    """Every line's groups for round ``round_`` of a swarm of about ``n``, deterministically.

    The peers of each line (:class:`Cell`) are ordered by their digit on the line's axis
    (then by ``sha256(round:peer)``) and dealt round-robin into
    ``ceil(size / G)`` groups, so each group spans the axis as a butterfly's would (a
    random cut mixed measurably slower); clients are then placed as :func:`form_groups`
    places them. Every peer that read its line's announcements computes its own group
    as every other peer on the line does. A peer alone on its line averages with no one
    that round.
    """
    lines: dict[Cell, list[str]] = {}
    for peer in sorted(set(peers)):
        lines.setdefault(Cell.of(peer, round_, fragment, group_size, n), []).append(peer)
    groups = []
    for cell in sorted(lines, key=lambda c: c.key):
        groups.extend(_deal(cell, lines[cell], round_, fragment))
    return _serve_clients(groups, round_, fragment, clients)


def _deal(cell: Cell, line: list[str], round_: int, fragment: int) -> list[list[str]]:
    def place(peer: str) -> tuple[int, bytes]:
        digit = _coords(peer, cell.group_size, cell.dims, cell.cycle)[cell.axis]
        return digit, _rank(round_, peer)

    count = _group_count(len(line), cell.group_size)
    groups: list[list[str]] = [[] for _ in range(count)]
    for i, peer in enumerate(sorted(line, key=place)):
        groups[i % count].append(peer)
    return [_in_order(g, round_, fragment) for g in groups]
