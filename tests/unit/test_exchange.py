"""One fragment's exchange without a network: who is grouped, who owns parts, mixing."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from protocol.averaging import matchmaking
from protocol.averaging.exchange import ExchangeSettings, FragmentExchange
from protocol.averaging.parts import AllReduceResult
from protocol.errors import ProtocolError
from tests.unit._fakes import FakeDHT, FakeTransport
from verification.identity import Identity

RUN, SPEC = "run", "a" * 64
ME, PEER, CLIENT, STRANGER = (Identity.from_seed(bytes([i]) * 32) for i in range(1, 5))


class FakeAllReduce:
    """Records each all-reduce it is asked for and answers with the input."""

    def __init__(self) -> None:
        self.current_round = 0
        self.calls: list[dict] = []

    async def run(
        self, round_, fragment, group, vector, weight, owners=None, deadline=None, content="update"
    ) -> AllReduceResult:
        self.calls.append(
            dict(
                round=round_,
                fragment=fragment,
                group=list(group),
                weight=weight,
                owners=owners,
                content=content,
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
    transport = FakeTransport(dht, ME.peer_id)
    return FragmentExchange(transport, ME, allreduce, settings, lambda: reachable), allreduce


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
    assert call["weight"] == 50 and done.mixed is None
    assert allreduce.current_round == 1


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
    gathering = matchmaking.gather(
        transport,
        ME,
        RUN,
        1,
        0,
        100,
        expected=peers,
        deadline=time.monotonic() + 30,
        expiration=60,
        timeout=1,
        base_rate_peers=8,
    )
    with pytest.raises(_Polled):
        asyncio.run(gathering)
    assert waits == [pytest.approx(poll)]
