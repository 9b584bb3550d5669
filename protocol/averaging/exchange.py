"""One fragment's exchange in a round: announce, agree on the groups, all-reduce.

Every node announces ``(round, fragment)`` in the DHT with its token count, its votes,
whether peers can dial it and the digest of the run spec it runs
(:mod:`protocol.averaging.matchmaking`). From the announcements every node computes the same
groups (:mod:`protocol.averaging.grouping`): peers on another spec and peers voted out by a
majority are left out, and peers that cannot be dialled own no part. The group then
all-reduces the fragment's pseudo-gradient (:mod:`protocol.averaging.allreduce`).

When a round's group does not span the swarm (more peers than the largest group, or
gossip pairs), or its members announced global copies with different digests (a swarm
that shrank to one group after mixing), members' global copies differ, so the group also
all-reduces its members' global copies (an exchange of content ``weights`` beside the ``update`` one,
:data:`~protocol.averaging.parts.Content`) with every member weighted alike. What to do with the two results is the outer
optimizer's business (:mod:`node.train.outer`).

In a swarm larger than ``cells_above`` no node reads every announcement: each announces
and reads only on its line of the cell grid (:class:`~protocol.averaging.grouping.Cell`),
waits only for the expected peers on that line, and forms its group with
:func:`~protocol.averaging.grouping.cell_groups`; groups then always mix global copies.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

import torch

from protocol.averaging import grouping, matchmaking
from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.grouping import Layout
from protocol.averaging.matchmaking import MatchmakingSettings
from protocol.averaging.parts import AllReduceResult
from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport
from verification.identity import Identity

__all__ = ["ExchangeOutcome", "ExchangeSettings", "FragmentExchange"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExchangeSettings:
    """What every node of a run must agree on to form the same groups, and deadlines.

    Attributes:
        run_id: the run.
        spec: digest of the run spec (or of the shared settings) this node runs.
        fragments: fragments in the model.
        group_size: the largest group (``network.group_size``).
        layout: how groups are laid out when one group cannot hold the swarm.
        gossip: pairs that always mix global copies (``sync.averaging = "gossip"``).
        matchmaking_seconds: how long to wait for expected peers' announcements.
        announce_expiration: seconds an announcement stays in the DHT.
        request_timeout: deadline of one DHT operation.
        base_rate_peers: peers above which announcement reads are spaced out.
        cells_above: swarm size above which matchmaking reads only this node's line of
            the cell grid (``network.cells_above``).
    """

    run_id: str
    spec: str
    fragments: int
    group_size: int
    layout: Layout = "butterfly"
    gossip: bool = False
    matchmaking_seconds: float = 3.0
    announce_expiration: float = 60.0
    request_timeout: float = 10.0
    base_rate_peers: int = 8
    cells_above: int = 256

    @property
    def largest_group(self) -> int:
        return 2 if self.gossip else self.group_size

    def mixes(self, swarm_size: int) -> bool:
        """Whether a swarm of ``swarm_size`` nodes also averages global copies (always
        on the cell grid: a line's groups never span the swarm)."""
        return self.gossip or swarm_size > self.largest_group or self.cells(swarm_size)

    def cells(self, swarm_size: int) -> bool:
        """Whether a swarm of ``swarm_size`` nodes matchmakes on the cell grid."""
        return swarm_size > self.cells_above and self.largest_group >= 2

    @property
    def matchmaking(self) -> MatchmakingSettings:
        """What announcing and waiting for the peers' announcements takes of these."""
        return MatchmakingSettings(
            run_id=self.run_id,
            spec=self.spec,
            wait_seconds=self.matchmaking_seconds,
            expiration=self.announce_expiration,
            request_timeout=self.request_timeout,
            base_rate_peers=self.base_rate_peers,
        )


@dataclass
class ExchangeOutcome:
    """What one exchange of a fragment produced.

    Attributes:
        group: the members, in group order.
        result: the averaged pseudo-gradient and who is in which part.
        mixed: the group's mean global copy, when the group mixes (else None).
        refused: announcers left out for running another spec: ``{peer: reason}``.
        cell: the key of the line of the cell grid it matchmade on, or None when it
            read the swarm's announcements (see :class:`ExchangeSettings`).
    """

    group: list[str]
    result: AllReduceResult
    mixed: AllReduceResult | None = None
    refused: dict[str, str] = field(default_factory=dict)
    cell: str | None = None


class FragmentExchange:
    """Runs the exchanges of one node.

    Args:
        transport: the node's transport (DHT for announcements; whether peers can dial
            this node is read from its reachability at each exchange).
        identity: the node's key (signs announcements).
        allreduce: the node's all-reduce service.
        settings: see :class:`ExchangeSettings`.
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        allreduce: AllReduceService,
        settings: ExchangeSettings,
    ) -> None:
        self.transport = transport
        self.identity = identity
        self.allreduce = allreduce
        self.settings = settings

    async def run(
        self,
        round_: int,
        fragment: int,
        weight: int,
        contribution: torch.Tensor,
        weights: torch.Tensor,
        expected: set[str],
        excludes: set[str],
        deadline: float | None = None,
        base: str = "",
        claim: dict | None = None,
    ) -> ExchangeOutcome:
        """Exchange ``fragment`` for ``round_``, all of it over by ``deadline``.

        Args:
            weight: this node's token weight for the pseudo-gradient.
            contribution: the encoded-and-decoded pseudo-gradient.
            weights: this node's global copy as it would send it, if the group mixes.
            expected: peers believed alive; matchmaking waits for their announcements.
            excludes: peers this node votes to leave out.
            deadline: ``time.monotonic()`` by which the exchange is over, whatever its
                peers do (default: matchmaking plus the all-reduce's own timeout).
            base: digest of this node's global copy of the fragment (announced).
            claim: the batches the pseudo-gradient was trained on, signed into its parts
                (:func:`protocol.averaging.contributions.open_contribution` reads it).

        Raises:
            ProtocolError: ``no_owner``: nobody in this node's group can be dialled.
        """
        s, me = self.settings, self.identity.peer_id
        self.allreduce.clock.start(round_)
        swarm = len(expected | {me})
        cell = None
        if s.cells(swarm):
            cell = grouping.Cell.of(me, round_, fragment, s.largest_group, swarm)
        announced = await self._announced(round_, fragment, weight, expected, excludes, cell, base)
        refused = self._other_specs(announced)
        same = {p: a for p, a in announced.items() if p not in refused}
        peers = set(same) - matchmaking.voted_out(same)
        clients = {p for p in peers if not same[p].reachable}
        group = self._group(peers, clients, round_, fragment, swarm, cell)
        owners = grouping.owners(group, clients)
        if not owners:
            raise ProtocolError("no_owner", "nobody in this node's group can be dialled")
        run = functools.partial(self.allreduce.run, owners=owners, deadline=deadline)
        update = run(round_, fragment, group, contribution, weight, claim=claim)
        apart = len({same[p].base for p in group if p in same}) > 1
        if cell is None and not s.mixes(len(peers | {me})) and not apart:
            return ExchangeOutcome(group, await update, None, refused)
        line = cell.key if cell is not None else None
        # Every member's global copy counts the same, whatever its token count.
        result, mixed = await asyncio.gather(
            update, run(round_, fragment, group, weights, 1, content="weights")
        )
        return ExchangeOutcome(group, result, mixed, refused, line)

    async def _announced(
        self,
        round_: int,
        fragment: int,
        weight: int,
        expected: set[str],
        excludes: set[str],
        cell: grouping.Cell | None,
        base: str,
    ) -> dict[str, matchmaking.Announcement]:
        """Announce this node, then gather the announcements of the expected peers (of
        those on this node's line, with a cell) until they are in or matchmaking is over."""
        if cell is not None:
            expected = {p for p in expected if cell.holds(p)}
        return await matchmaking.gather(
            self.transport,
            self.identity,
            self.settings.matchmaking,
            round_,
            fragment,
            weight,
            expected=expected,
            excludes=excludes,
            reachable=self.transport.reachability.reachable,
            cell=cell,
            base=base,
        )

    def _other_specs(self, announced: dict[str, matchmaking.Announcement]) -> dict[str, str]:
        """Announcers running another spec than this node, with why they are refused."""
        spec = self.settings.spec
        return {
            p: f"spec_mismatch: announces spec {a.spec[:12] or '(none)'}, this node runs {spec[:12]}"
            for p, a in announced.items()
            if a.spec != spec
        }

    def _group(
        self,
        peers: set[str],
        clients: set[str],
        round_: int,
        fragment: int,
        swarm: int,
        cell: grouping.Cell | None,
    ) -> list[str]:
        """This node's group among the announced ``peers`` (on its line, with a cell)."""
        s, me = self.settings, self.identity.peer_id
        if cell is None:
            return grouping.group_of(
                me, peers, round_, fragment, s.largest_group, s.layout, clients=clients
            )
        lines = grouping.cell_groups(
            peers | {me}, round_, fragment, s.largest_group, swarm, clients
        )
        return next(g for g in lines if me in g)
