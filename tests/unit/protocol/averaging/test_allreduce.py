"""The all-reduce service without a network: a group of one, and a client's plan."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol.averaging.allreduce import AllReduceService
from protocol.averaging.parts import AllReduceSettings
from protocol.wire import codec as codecs
from verification.identity import Identity


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_group_of_one_needs_no_network(codec: str) -> None:
    # A node alone in its group still runs the all-reduce (the daemon does); it must finish
    # at once without touching the transport, and say it is complete.
    me = Identity.from_seed(bytes(32))
    service = AllReduceService(None, me, AllReduceSettings(run_id="r", codec=codec, timeout=5))
    vector = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    result = asyncio.run(service.run(0, 0, [me.peer_id], vector, 3))
    assert result.complete
    assert result.contributors == [[me.peer_id]]
    assert result.fallback_parts == []
    assert result.seconds < 1.0  # did not wait for its own deadline
    if codec == "none":
        assert torch.equal(result.vector, vector)
    else:  # the owner's result is always what it would send: the int8 round trip
        assert torch.equal(result.vector, codecs.decode(codecs.encode(vector, "int8")))


def test_result_is_written_into_the_callers_output() -> None:
    me = Identity.from_seed(bytes(32))
    service = AllReduceService(None, me, AllReduceSettings(run_id="r", codec="none", timeout=5))
    vector = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = torch.full_like(vector, float("nan"))
    for round_ in (0, 1):  # the same output, round after round
        result = asyncio.run(service.run(round_, 0, [me.peer_id], vector, 3, out=out))
        assert result.vector is out
        assert torch.equal(out, vector)


@pytest.mark.parametrize(
    "out",
    [torch.empty(999), torch.empty(1000, dtype=torch.float64), "itself"],
    ids=["too-short", "float64", "itself"],
)
def test_an_output_that_does_not_fit_is_refused_before_anything_is_sent(out: object) -> None:
    me = Identity.from_seed(bytes(32))
    service = AllReduceService(None, me, AllReduceSettings(run_id="r", codec="none", timeout=5))
    vector = torch.randn(1000)
    with pytest.raises(ValueError, match="out must be"):
        asyncio.run(
            service.run(0, 0, [me.peer_id], vector, 3, out=vector if out == "itself" else out)
        )


def test_an_owner_refuses_a_forged_part_on_its_head_before_any_body_byte() -> None:
    # The part announces 8 MiB of body; only its head and (wrong) signature ever arrive,
    # and the stream stays open: the owner answers bad_signature all the same.
    import struct

    from protocol.p2p import _framing
    from protocol.wire.messages import Header
    from protocol.wire.partwire import seal_part
    from tests.unit.protocol.p2p.test_framing import _stream

    me, sender = Identity.from_seed(b"o" * 32), Identity.from_seed(b"s" * 32)
    service = AllReduceService(None, me, AllReduceSettings(run_id="r", codec="none", timeout=5))
    body = bytes(8 << 20)
    sealed = seal_part(sender, Header("part", "r", 0, 0, 0, sender.peer_id), {"c": "none"}, body)
    signature = bytes(64)  # not the sender's
    wire = b"".join([sealed.buffers()[0], sealed.head, signature])
    length = len(wire) + len(body)
    handled: list[object] = []

    async def handler(peer: str, part: object) -> bytes:
        handled.append(part)
        return b""

    async def main() -> tuple[int, str]:
        stream = _stream(sender.peer_id)
        stream[1].feed_data(struct.pack(">Q", length) + wire)  # no body, no EOF
        serving = _framing.serve(
            stream, handler, 1 << 30, "atoll.part", 5.0, receive=service.read_part
        )
        await asyncio.wait_for(serving, 3)
        status, reply = stream[2].response()
        return status, _framing.decode_error(reply)[0]

    assert asyncio.run(main()) == (_framing.STATUS_ERROR, "bad_signature")
    assert handled == [] and service.context.rejected == {"bad_signature": 1}
    assert service.context.pool.allocated == 0  # no buffer was taken for the body
