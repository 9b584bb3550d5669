"""One fragment's exchange without a network: who is grouped, who owns parts, mixing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol.averaging import grouping, matchmaking
from protocol.averaging.exchange import ExchangeSettings, FragmentExchange
from protocol.averaging.parts import AllReduceResult
from protocol.errors import ProtocolError
from protocol.p2p.reachability import Reachability
from tests.unit._fakes import FakeDHT, FakeTransport
from verification.identity import Identity
from verification.rounds import RoundClock

RUN, SPEC = "run", "a" * 64
ME, PEER, CLIENT, STRANGER = (Identity.from_seed(bytes([i]) * 32) for i in range(1, 5))


class FakeAllReduce:
    """Records each all-reduce it is asked for and answers with the input."""

    def __init__(self) -> None:
        self.clock = RoundClock()
        self.calls: list[dict] = []

    async def run(
        self,
        round_,
        fragment,
        group,
        vector,
        weight,
        owners=None,
        deadline=None,
        content="update",
        claim=None,
    ) -> AllReduceResult:
        self.calls.append(
            dict(
                round=round_,
                fragment=fragment,
                group=list(group),
                weight=weight,
                owners=owners,
                content=content,
                claim=claim,
            )
        )
        return AllReduceResult(vector, list(group), [list(group)], [], owners=list(owners or group))


def _announce(dht: FakeDHT, who: Identity, **kw) -> None:
    transport = FakeTransport(dht, who.peer_id)
    asyncio.run(
        matchmaking.announce(transport, who, RUN, 1, 0, 100, expiration=60, timeout=1, **kw)
    )


def _exchange(dht: FakeDHT, group_size: int = 4, reachable: bool = True, **kw):
    allreduce = FakeAllReduce()
    settings = ExchangeSettings(
        RUN, SPEC, fragments=2, group_size=group_size, matchmaking_seconds=0.3, **kw
    )
    dialled = Reachability("public" if reachable else "private")
    transport = FakeTransport(dht, ME.peer_id, reachability=dialled)
    return FragmentExchange(transport, ME, allreduce, settings), allreduce


def _run(exchange: FragmentExchange, expected: set[str]):
    vector = torch.ones(8)
    return asyncio.run(exchange.run(1, 0, 50, vector, vector * 2, expected, set()))


def test_spec_strangers_are_refused_and_clients_own_no_part() -> None:
    dht = FakeDHT()
    _announce(dht, PEER, spec=SPEC)
    _announce(dht, CLIENT, spec=SPEC, reachable=False)
    _announce(dht, STRANGER, spec="b" * 64)
    exchange, allreduce = _exchange(dht)
    done = _run(exchange, {PEER.peer_id, CLIENT.peer_id})
    assert set(done.group) == {ME.peer_id, PEER.peer_id, CLIENT.peer_id}
    assert list(done.refused) == [STRANGER.peer_id]
    assert done.refused[STRANGER.peer_id].startswith("spec_mismatch: announces spec bbbbbbbbbbbb")
    (call,) = allreduce.calls  # one group spans the swarm: no mixing
    assert CLIENT.peer_id not in call["owners"] and set(call["owners"]) == {
        ME.peer_id,
        PEER.peer_id,
    }
    assert call["weight"] == 50 and done.mixed is None and done.cell is None
    assert allreduce.clock.current == 1


def test_this_node_announces_whether_it_can_be_dialled() -> None:
    dht = FakeDHT()
    _announce(dht, PEER, spec=SPEC)
    exchange, allreduce = _exchange(dht, reachable=False)
    _run(exchange, {PEER.peer_id})
    mine = asyncio.run(
        matchmaking.read_announcements(FakeTransport(dht, ME.peer_id), RUN, 1, 0, timeout=1)
    )[ME.peer_id]
    assert mine.reachable is False and mine.spec == SPEC
    assert allreduce.calls[0]["owners"] == [PEER.peer_id]


def test_a_group_whose_members_hold_different_copies_mixes_them() -> None:
    """A swarm that shrank to one group after mixing: its members' global copies still
    differ (their announced digests say so), and the group averages them before it steps,
    so they agree again and share one base."""
    dht = FakeDHT()
    _announce(dht, PEER, spec=SPEC, base="b" * 64)
    exchange, allreduce = _exchange(dht)
    done = asyncio.run(
        exchange.run(1, 0, 50, torch.ones(8), torch.ones(8), {PEER.peer_id}, set(), base="a" * 64)
    )
    assert done.mixed is not None and len(done.group) == 2
    assert sorted(c["content"] for c in allreduce.calls) == ["update", "weights"]
    # the same copy announced by both: one exchange, no mixing
    dht = FakeDHT()
    _announce(dht, PEER, spec=SPEC, base="a" * 64)
    exchange, allreduce = _exchange(dht)
    claim = {"spans": [[1, 0, 4]], "ranks": 1, "slice": [0, 1], "batch": 8}
    done = asyncio.run(
        exchange.run(
            1, 0, 50, torch.ones(8), torch.ones(8), {PEER.peer_id}, set(), None, "a" * 64, claim
        )
    )
    assert done.mixed is None and [c["content"] for c in allreduce.calls] == ["update"]
    assert allreduce.calls[0]["claim"] == claim


def test_groups_that_do_not_span_the_swarm_also_mix_global_copies() -> None:
    dht = FakeDHT()
    for who in (PEER, CLIENT, STRANGER):
        _announce(dht, who, spec=SPEC)
    exchange, allreduce = _exchange(dht, group_size=2)
    done = _run(exchange, {PEER.peer_id, CLIENT.peer_id, STRANGER.peer_id})
    assert done.mixed is not None and len(done.group) == 2
    exchanges = sorted((c["fragment"], c["content"], c["weight"]) for c in allreduce.calls)
    # the same fragment twice: the update weighted by tokens, the global copies alike
    assert exchanges == [(0, "update", 50), (0, "weights", 1)]


def test_a_group_with_nobody_to_dial_fails_clearly() -> None:
    dht = FakeDHT()
    _announce(dht, CLIENT, spec=SPEC, reachable=False)
    exchange, _ = _exchange(dht, reachable=False)
    with pytest.raises(ProtocolError, match="no_owner"):
        _run(exchange, {CLIENT.peer_id})


class _Polled(Exception):
    pass


@pytest.mark.parametrize(("expected", "poll"), [(3, 0.2), (7, 0.2), (15, 0.4), (31, 0.8)])
def test_announcement_reads_are_spaced_out_as_the_swarm_grows(
    monkeypatch, expected: int, poll: float
) -> None:
    # every read returns every announcement: above base_rate_peers (8) nodes the reads
    # are spaced by 0.2 s * n / 8, so a waiting node reads as many bytes per second
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        raise _Polled

    monkeypatch.setattr(matchmaking.asyncio, "sleep", sleep)
    transport = FakeTransport(FakeDHT(), ME.peer_id)
    peers = {f"peer{i}" for i in range(expected)}
    settings = matchmaking.MatchmakingSettings(
        RUN, wait_seconds=30, expiration=60, request_timeout=1, base_rate_peers=8
    )
    gathering = matchmaking.gather(transport, ME, settings, 1, 0, 100, expected=peers)
    with pytest.raises(_Polled):
        asyncio.run(gathering)
    assert waits == [pytest.approx(poll)]


def test_above_cells_above_a_node_reads_only_its_line_and_agrees_on_its_group() -> None:
    dht = FakeDHT()
    nodes = [Identity.from_seed(bytes([10 + i]) * 32) for i in range(40)]
    names = {n.peer_id for n in nodes}
    settings = ExchangeSettings(
        RUN, SPEC, fragments=1, group_size=4, matchmaking_seconds=0.3, cells_above=16
    )
    cells = {n.peer_id: grouping.Cell.of(n.peer_id, 1, 0, 4, 40) for n in nodes}
    for n in nodes:  # everyone has announced on its line before anyone reads
        transport = FakeTransport(dht, n.peer_id)
        asyncio.run(
            matchmaking.announce(
                transport,
                n,
                RUN,
                1,
                0,
                100,
                expiration=60,
                timeout=1,
                spec=SPEC,
                cell=cells[n.peer_id],
            )
        )
    groups = {}
    for n in nodes:
        allreduce = FakeAllReduce()
        exchange = FragmentExchange(FakeTransport(dht, n.peer_id), n, allreduce, settings)
        vector = torch.ones(8)
        done = asyncio.run(exchange.run(1, 0, 50, vector, vector, names - {n.peer_id}, set()))
        groups[n.peer_id] = done.group
        assert all(cells[n.peer_id].holds(p) for p in done.group)
        # groups never span the swarm here: global copies are mixed as well
        assert sorted(c["content"] for c in allreduce.calls) == ["update", "weights"]
        assert done.cell == cells[n.peer_id].key
    # one key per line holding only its peers (each node re-announced there), none
    # under the swarm-wide key
    assert f"{RUN}:mm:1:0" not in dht.data
    for key, entries in dht.data.items():
        (line,) = {cells[p].key for p in entries}
        assert key == f"{RUN}:mm:1:0:{line}"
    for me, group in groups.items():
        assert me in group and all(groups[p] == group for p in group)
    assert sorted(map(sorted, {tuple(g) for g in groups.values()})) == sorted(
        map(sorted, grouping.cell_groups(names, 1, 0, 4, 40))
    )


def test_an_announcement_from_off_the_line_is_dropped() -> None:
    dht = FakeDHT()
    nodes = [Identity.from_seed(bytes([60 + i]) * 32) for i in range(40)]
    mine = grouping.Cell.of(nodes[0].peer_id, 1, 0, 4, 40)
    stranger = next(n for n in nodes if not mine.holds(n.peer_id))
    neighbour = next(n for n in nodes[1:] if mine.holds(n.peer_id))
    for who in (stranger, neighbour):  # the stranger writes itself under this line's key
        asyncio.run(
            matchmaking.announce(
                FakeTransport(dht, who.peer_id),
                who,
                RUN,
                1,
                0,
                100,
                expiration=60,
                timeout=1,
                cell=mine,
            )
        )
    found = asyncio.run(
        matchmaking.read_announcements(
            FakeTransport(dht, nodes[0].peer_id), RUN, 1, 0, timeout=1, cell=mine
        )
    )
    assert set(found) == {neighbour.peer_id}
