"""A member's kept contribution: kept per exchange for a few rounds, served, and opened by
a checker only when every part is signed, of the exchange, and the one committed; the
work it claims is read from its parts' heads, and refused when malformed."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest
import torch

from protocol.averaging.contributions import (
    ROUNDS_KEPT,
    SentParts,
    WorkClaim,
    open_contribution,
)
from protocol.averaging.parts import AllReduceSettings, PartPlan
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart, seal_part
from verification.identity import Identity

ME = Identity.from_seed(b"m" * 32)
OTHER = Identity.from_seed(b"o" * 32)
GROUP = [ME.peer_id, OTHER.peer_id, "12D3KooWThird"]
SETTINGS = AllReduceSettings(run_id="run", codec="int8", block_size=16)
NUMEL = 96


CLAIM = WorkClaim(((2, 0, 6), (3, 0, 4)), ranks=2, slice=(1, 3), batch=8)
CLAIMED = CLAIM.to_wire()


def _parts(
    vector: torch.Tensor,
    key=(3, 0),
    weight: int = 512,
    who: Identity = ME,
    content: str = "update",
    work=CLAIMED,
) -> dict[int, SealedPart]:
    plan = PartPlan.of(who.peer_id, GROUP, GROUP, NUMEL, SETTINGS.block_size)
    out = {}
    for j, (lo, hi) in enumerate(plan.bounds):
        enc = codecs.encode(vector[lo:hi], "int8", block_size=16)
        header = Header("part", "run", key[0], key[1], j, who.peer_id)
        meta = {"content": content, "group": GROUP, "owners": GROUP, "weight": weight}
        if work is not None:
            meta["work"] = work[j] if isinstance(work, list) else work
        out[j] = seal_part(who, header, {**meta, **enc.meta()}, enc.payload)
    return out


def _committed(parts: dict[int, SealedPart], own: int = 0, content: str = "update"):
    digests = {j: p.digest for j, p in parts.items() if j != own}
    return lambda peer, r, f, c: dict(digests) if c == content else None


def _served(parts: dict[int, SealedPart]) -> bytes:
    return msgpack.packb([parts[j].to_bytes() for j in sorted(parts)])


def test_a_served_contribution_opens_to_what_the_owners_decode() -> None:
    vector = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    parts = _parts(vector)
    fetched = open_contribution(
        _served(parts), ME.peer_id, (3, 0), NUMEL, SETTINGS, _committed(parts)
    )
    expected = codecs.decode(codecs.encode(vector, "int8", block_size=16))
    assert torch.equal(fetched.vector, expected) and fetched.tokens == 512
    assert fetched.digests == [parts[j].digest for j in sorted(parts)]
    assert fetched.claim == CLAIM and fetched.claim.batches == 2 * (6 + 4)


def test_a_gathered_contribution_is_its_one_committed_part() -> None:
    # in a gather a member signs one part, its whole vector under its own index, and
    # sends everyone the same bytes: the part it committed to
    settings = dataclasses.replace(SETTINGS, gather=True)
    vector = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    enc = codecs.encode(vector, "int8", block_size=16)

    def part(values: torch.Tensor) -> dict[int, SealedPart]:
        header = Header("part", "run", 3, 0, 0, ME.peer_id)
        meta = {"content": "update", "group": GROUP, "owners": GROUP, "weight": 7,
                "work": CLAIMED, "exchange": "gather"}  # fmt: skip
        coded = codecs.encode(values, "int8", block_size=16)
        return {0: seal_part(ME, header, {**meta, **coded.meta()}, coded.payload)}

    one = part(vector)
    committed = _committed(one, own=-1)
    fetched = open_contribution(_served(one), ME.peer_id, (3, 0), NUMEL, settings, committed)
    assert torch.equal(fetched.vector, codecs.decode(enc)) and fetched.tokens == 7
    # not the part committed to (it is checked, though it is the sender's own index)
    other = part(vector + 1)
    refused = open_contribution
    with pytest.raises(ProtocolError) as err:
        refused(_served(other), ME.peer_id, (3, 0), NUMEL, settings, committed)
    assert err.value.reason == "commit_mismatch"
    # read as parts reduced by owner, one part is not one per owner
    assert _refused(_served(one), committed) == "malformed"


def test_a_copy_sent_to_mix_opens_as_such_and_never_as_an_update() -> None:
    vector = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    copy = _parts(vector, weight=1, content="weights", work=None)
    committed = _committed(copy, content="weights")
    fetched = open_contribution(
        _served(copy), ME.peer_id, (3, 0), NUMEL, SETTINGS, committed, "weights"
    )
    assert fetched.claim is None and fetched.tokens == 1
    assert _refused(_served(copy), committed) == "uncommitted"
    assert _refused(_served(copy), _committed(copy)) == "not_in_round"


def test_kept_parts_are_served_for_a_few_rounds() -> None:
    store = SentParts()
    parts = _parts(torch.ones(NUMEL))
    copy = _parts(torch.zeros(NUMEL), content="weights", work=None)
    store.keep((1, 0, "update"), parts)
    store.keep((1, 0, "weights"), copy)
    assert store.get(1, 0) == [parts[j].to_bytes() for j in sorted(parts)]
    assert store.get(1, 0, "weights") == [copy[j].to_bytes() for j in sorted(copy)]
    served = asyncio.run(store.serve("peer", msgpack.packb([1, 0])))
    assert msgpack.unpackb(served) == store.get(1, 0)
    served = asyncio.run(store.serve("peer", msgpack.packb([1, 0, "weights"])))
    assert msgpack.unpackb(served) == store.get(1, 0, "weights")
    assert msgpack.unpackb(asyncio.run(store.serve("peer", msgpack.packb([9, 0])))) == []
    store.keep((1 + ROUNDS_KEPT, 0, "update"), parts)
    assert store.get(1, 0) is None and store.get(1, 0, "weights") is None
    for bad in (b"\xc1", msgpack.packb([1]), msgpack.packb([1, 0, "secrets"])):
        with pytest.raises(ProtocolError, match="malformed"):
            asyncio.run(store.serve("peer", bad))


def _refused(data: bytes, committed, peer: str = ME.peer_id, key=(3, 0)) -> str:
    with pytest.raises(ProtocolError) as err:
        open_contribution(data, peer, key, NUMEL, SETTINGS, committed)
    return err.value.reason


def test_every_bad_contribution_is_refused_with_its_reason() -> None:
    vector = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    parts = _parts(vector)
    ok = _committed(parts)
    assert _refused(_served(parts), lambda *a: None) == "uncommitted"
    # a part other than the one committed (a better one, served only to its checker)
    swapped = {**parts, 1: _parts(vector * 2)[1]}
    assert _refused(_served(swapped), ok) == "commit_mismatch"
    # parts of another round, or signed by another peer
    assert _refused(_served(_parts(vector, key=(4, 0))), ok) == "not_in_round"
    assert _refused(_served(parts), ok, peer=OTHER.peer_id) == "sender_mismatch"
    assert _refused(_served({0: parts[0], 2: parts[2]}), ok) == "malformed"
    assert _refused(b"\xc1", ok) == "malformed"
    assert _refused(msgpack.packb([]), ok) == "malformed"
    # parts claiming different weights, or different work
    mixed = {**parts, 2: _parts(vector, weight=9)[2]}
    assert _refused(_served(mixed), _committed(mixed)) == "malformed"
    other = {**parts, 1: _parts(vector, work=WorkClaim(((2, 0, 1),)).to_wire())[1]}
    assert _refused(_served(other), _committed(other)) == "malformed"


@pytest.mark.parametrize(
    "work",
    [
        "ten batches",
        {"spans": [[2, 0, 6]], "ranks": 1, "slice": [0, 1]},  # a key missing
        {"spans": [[2, 0, 0]], "ranks": 1, "slice": [0, 1], "batch": 8},  # an empty span
        {"spans": [[2, -1, 3]], "ranks": 1, "slice": [0, 1], "batch": 8},
        {"spans": [[2, 0, 3]] * 65, "ranks": 1, "slice": [0, 1], "batch": 8},
        {"spans": [[2, 0, 3]], "ranks": 0, "slice": [0, 1], "batch": 8},
        {"spans": [[2, 0, 3]], "ranks": 1, "slice": [1, 1], "batch": 8},  # no slice 1 of 1
        {"spans": [[2, 0, 3]], "ranks": 1, "slice": [0, 1], "batch": True},
        {"spans": [[2, 0, 3.5]], "ranks": 1, "slice": [0, 1], "batch": 8},
    ],
)
def test_a_malformed_work_claim_is_refused(work) -> None:
    parts = _parts(torch.ones(NUMEL), work=work)
    assert _refused(_served(parts), _committed(parts)) == "malformed"
