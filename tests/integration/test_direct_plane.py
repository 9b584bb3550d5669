"""The direct TCP data plane between real transports (p2pd, DHT) on 127.0.0.1: parts go
over it where both sides run it, through p2pd where one does not or where the port
answers with the wrong key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from protocol.averaging.allreduce import RPC_NAME, AllReduceService
from protocol.averaging.parts import AllReduceSettings, PartPlan
from protocol.averaging.sealing import sign_part
from protocol.p2p import _frames, direct
from protocol.p2p.transport import Transport, TransportConfig
from protocol.wire.partwire import SealedPart
from tests.waiting import wait_until
from verification.identity import Identity

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    keys: Path = tmp_path_factory.mktemp("keys")
    identities = [Identity.generate() for _ in range(3)]
    planes = ["tcp", "tcp", "p2pd"]
    transports: list[Transport] = []
    try:
        for i, (identity, plane) in enumerate(zip(identities, planes)):
            identity.save(keys / f"key{i}")
            config = TransportConfig(
                identity_path=keys / f"key{i}",
                initial_peers=tuple(transports[0].maddrs) if transports else (),
                request_timeout=10.0,
                data_plane=plane,  # type: ignore[arg-type]
            )
            transports.append(Transport.start(config))
        yield SimpleNamespace(transports=transports, identities=identities)
    finally:
        for transport in reversed(transports):
            transport.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stream_reduce", [False, True], ids=["whole", "streamed"])
def test_parts_go_direct_where_both_sides_can_and_through_p2pd_otherwise(
    trio: SimpleNamespace, stream_reduce: bool
) -> None:
    a, b, c = trio.transports
    assert a.data_port and b.data_port and c.data_port is None
    settings = AllReduceSettings(
        run_id=f"direct-{stream_reduce}", codec="none", timeout=20, stream_reduce=stream_reduce
    )
    services = [AllReduceService(t, i, settings) for t, i in zip(trio.transports, trio.identities)]
    for service in services:
        service.register()
    try:
        group = [i.peer_id for i in trio.identities]
        gen = torch.Generator().manual_seed(3)
        # streamed: parts of three 1 MiB blocks, results sent back as they are reduced
        numel = 9 * (1 << 18) if stream_reduce else 300_000
        vectors = [torch.randn(numel, generator=gen) for _ in group]
        expected = (sum(v.double() for v in vectors) / 3).float()
        opened = []
        for round_ in (1, 2):
            for s in services:
                s.clock.start(round_)
            futures = [
                s.transport.submit(s.run(round_, 0, group, v, 1)) for s, v in zip(services, vectors)
            ]
            results = [f.result(60) for f in futures]
            for r in results:
                assert r.complete
                assert torch.equal(r.vector, results[0].vector)
            torch.testing.assert_close(results[0].vector, expected, rtol=0, atol=1e-6)
            opened.append(a._endpoints.direct_client.opened)
        # a and b sent each other their parts over TCP; everyone reached c through p2pd,
        # and c (which runs p2pd only) reached a and b through p2pd
        assert a.calls_by_plane["tcp"] >= 2 and b.calls_by_plane["tcp"] >= 2
        assert a.calls_by_plane["p2pd"] >= 2 and c.calls_by_plane["tcp"] == 0
        assert opened[1] == opened[0]  # the second round reused the first round's connections
        # a streamed result ends with its trailer frame: the connection stays usable
        streamed = sum(s.context.results_streamed for s in services)
        assert streamed > 0 if stream_reduce else streamed == 0
    finally:
        for s in services:
            s.unregister()


async def _forget_connections(transport: Transport) -> None:
    transport._endpoints.direct_client.close()


@pytest.mark.timeout(60)
def test_a_data_port_answered_by_another_key_falls_back_to_p2pd(trio: SimpleNamespace) -> None:
    a, b, _ = trio.transports
    served: list[str] = []

    async def echo(peer: str, data: bytes) -> bytes:
        served.append(peer)
        return bytes(data)

    b.add_handler("atoll.test_echo", echo, max_request_bytes=1 << 20)
    try:
        # a believes b's data port is a's own (and holds no open connection to b): the
        # port answers with a's key, not b's
        a.run(_forget_connections(a), 5)
        wrong = direct.Route("127.0.0.1", a.data_port)
        a._endpoints.caller.routes[b.peer_id] = (wrong, time.monotonic() + 600)
        before = dict(a.calls_by_plane)
        answer = a.run(a.call(b.peer_id, "atoll.test_echo", b"hello", timeout=10), 15)
        assert answer == b"hello" and served == [a.peer_id]
        assert a.calls_by_plane["p2pd"] == before["p2pd"] + 1
        assert a.calls_by_plane["tcp"] == before["tcp"]
        assert a._endpoints.direct_server.refused.get("wrong_peer", 0) >= 1
        assert a._endpoints.caller.routes[b.peer_id][0] is None  # not tried again for a while
    finally:
        b.remove_handler("atoll.test_echo")


@pytest.mark.timeout(90)
def test_an_encrypted_data_plane_is_used_both_ways_it_may_be(tmp_path: Path) -> None:
    # "tls" encrypts its port; a "tcp" node calls it over TLS, while the "tls" node,
    # which never sends in the clear, calls the "tcp" node's plain port through p2pd
    identities = [Identity.generate() for _ in range(2)]
    transports: list[Transport] = []
    served: list[str] = []

    async def echo(peer: str, data: bytes) -> bytes:
        served.append(peer)
        return bytes(data)

    try:
        for i, (identity, plane) in enumerate(zip(identities, ["tls", "tcp"])):
            identity.save(tmp_path / f"key{i}")
            config = TransportConfig(
                identity_path=tmp_path / f"key{i}",
                initial_peers=tuple(transports[0].maddrs) if transports else (),
                request_timeout=10.0,
                data_plane=plane,  # type: ignore[arg-type]
            )
            transports.append(Transport.start(config))
        secure, plain = transports
        for t in transports:
            t.add_handler("atoll.test_echo", echo, max_request_bytes=1 << 20)
        big = torch.arange(250_000, dtype=torch.float32).numpy().tobytes()
        before = [dict(t.calls_by_plane) for t in transports]  # start-up probes went via p2pd
        assert plain.run(plain.call(secure.peer_id, "atoll.test_echo", big, timeout=10), 15) == big
        assert (
            secure.run(secure.call(plain.peer_id, "atoll.test_echo", b"x", timeout=10), 15) == b"x"
        )
        calls = [{k: t.calls_by_plane[k] - b[k] for k in b} for t, b in zip(transports, before)]
        assert calls == [{"p2pd": 1, "tcp": 0, "tls": 0}, {"p2pd": 0, "tcp": 0, "tls": 1}]
        assert served == [plain.peer_id, secure.peer_id]
    finally:
        for transport in reversed(transports):
            transport.shutdown()


async def _stall_mid_part(
    client: direct.DirectClient, owner: str, port: int, request: SealedPart, hold: float
) -> None:
    """Send ``request`` to ``owner`` as a caller that stops after half of its body and
    keeps the connection open for ``hold`` seconds (a sender whose machine froze)."""
    reader, writer = await client._connect(owner, direct.Route("127.0.0.1", port))
    wire = b"".join(bytes(b) for b in request.buffers())
    name = RPC_NAME.encode()
    writer.write(bytes([len(name)]) + name + _frames._REQUEST_HEADER.pack(len(wire)))
    writer.write(wire[: len(wire) - request.body.nbytes // 2])
    await writer.drain()
    await asyncio.sleep(hold)
    writer.close()


@pytest.mark.timeout(90)
def test_a_member_that_stops_sending_mid_part_costs_only_its_contribution(
    tmp_path: Path,
) -> None:
    # Four nodes on the direct plane; the fourth sends every owner the first half of its
    # part and then nothing, holding its connections open past the exchange. The owners
    # reduce without it at their deadline, every member ends with the same values, the
    # fourth's own part is repaired among the others, and the half-read parts give their
    # receive buffers back.
    identities = [Identity.generate() for _ in range(4)]
    transports: list[Transport] = []
    services: list[AllReduceService] = []
    timeout, numel = 4.0, 1_200_000  # parts of 1.2 MB: read into pooled buffers
    try:
        for i, identity in enumerate(identities):
            identity.save(tmp_path / f"key{i}")
            config = TransportConfig(
                identity_path=tmp_path / f"key{i}",
                initial_peers=tuple(transports[0].maddrs) if transports else (),
                request_timeout=10.0,
                data_plane="tcp",
            )
            transports.append(Transport.start(config))
        settings = AllReduceSettings(run_id="stall", codec="none", timeout=timeout)
        services = [AllReduceService(t, i, settings) for t, i in zip(transports, identities)]
        for s in services:
            s.register()
            s.clock.start(1)
        group = [i.peer_id for i in identities]
        gen = torch.Generator().manual_seed(5)
        vectors = [torch.randn(numel, generator=gen) for _ in group]
        frozen = services[3]
        plan = PartPlan.of(group[3], group, group, numel, settings.block_size)
        client = direct.DirectClient(identities[3])
        stalls = []
        for j, (lo, hi) in enumerate(plan.bounds[:3]):
            request = sign_part(frozen.context, (1, 0, "update"), plan, j, vectors[3][lo:hi], 1)
            stall = _stall_mid_part(client, group[j], transports[j].data_port, request, timeout + 3)
            stalls.append(frozen.transport.submit(stall))
        started = time.monotonic()
        futures = [
            s.transport.submit(s.run(1, 0, group[:4], v, 1)) for s, v in zip(services[:3], vectors)
        ]
        results = [f.result(timeout + 10) for f in futures]
        elapsed = time.monotonic() - started
        for stall in stalls:
            stall.result(timeout + 10)
        assert elapsed < timeout + 2.0  # nobody waited on the frozen sender past the deadline
        expected = (sum(v.double() for v in vectors[:3]) / 3).float()
        for r in results:
            assert group[3] not in r.peers_in
            assert r.repaired_parts == [3] and r.fallback_parts == []
            torch.testing.assert_close(r.vector, expected, rtol=0, atol=1e-6)
            assert torch.equal(r.vector, results[0].vector)
        owners = services[:3]
        # the cut connections are noticed within moments
        wait_until(
            lambda: all(len(s.context.pool._idle) == s.context.pool.allocated for s in owners),
            2,
            0.05,
        )
        assert all(s.context.pool.allocated >= 1 for s in owners)
        assert [len(s.context.pool._idle) for s in owners] == [
            s.context.pool.allocated for s in owners
        ]
    finally:
        for s in services:
            s.unregister()
        for transport in reversed(transports):
            transport.shutdown()
