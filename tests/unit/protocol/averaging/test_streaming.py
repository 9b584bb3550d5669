"""An owner's part reduced block by block while the parts arrive: bitwise the reduction
of the whole parts, for every aggregator, and given up whenever it could differ."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from protocol.averaging.parts import weighted_mean_plan, weighted_mean_reducer
from protocol.averaging.streaming import StreamingReduction
from protocol.wire import codec as codecs
from verification.aggregators import AGGREGATORS, COORDINATEWISE, aggregate
from verification.policy import TrustPolicy
from verification.records import Contribution
from verification.verifier import Verifier

ME = "me"
PEERS = [ME, "p1", "p2", "p3", "p4"]
NUMEL = 20_003
BLOCK = 1_024
PARAMS = {"trimmed_mean": {"trim": 0.2}, "krum": {"f": 1}, "multi_krum": {"f": 1}}


def _vectors(seed: int, outlier: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=g)
    out = {p: base + 0.1 * torch.randn(NUMEL, generator=g) for p in PEERS}
    out["p3"] = out["p3"] * outlier
    return out


def _encoded(values: torch.Tensor, codec: str) -> codecs.Encoded:
    enc = codecs.encode(values, codec, block_size=256)
    return codecs.Encoded.from_meta(enc.meta(), bytes(enc.payload), max_numel=NUMEL)


def _contributions(
    vectors: dict[str, torch.Tensor], codec: str, peers: list[str] = PEERS
) -> list[Contribution]:
    """What the owner decodes once each part is fully in (its own values as they are)."""
    out = []
    for i, p in enumerate(peers):
        values = vectors[p] if p == ME else codecs.decode(_encoded(vectors[p], codec))
        out.append(Contribution(p, values, float(10 + i), bytes(32), 10 + i))
    return out


def _stream(
    vectors: dict[str, torch.Tensor],
    codec: str,
    planner,
    seed: int,
    stall: str | None = None,
) -> StreamingReduction:
    """Members' payloads arrive in random pieces, interleaved; blocks are reduced as
    soon as every member has them. ``stall`` stops sending halfway."""
    streaming = StreamingReduction(NUMEL, (ME, vectors[ME]), block=BLOCK)
    sizes = {}
    for p in PEERS[1:]:
        enc = _encoded(vectors[p], codec)
        assert streaming.attach(p, enc)
        sizes[p] = memoryview(enc.payload).nbytes
    plan = planner(3, [(p, float(10 + i)) for i, p in enumerate(PEERS)])
    if plan is None:
        return streaming
    streaming.start(plan)
    rng = random.Random(seed)
    got = dict.fromkeys(sizes, 0)
    for _ in range(10_000):
        open_ = [p for p in sizes if got[p] < (sizes[p] // 2 if p == stall else sizes[p])]
        if not open_:
            break
        p = rng.choice(open_)
        got[p] = min(sizes[p], got[p] + rng.randint(1, 9_000))
        streaming.arrived(p, got[p])
        ready = streaming.ready()
        if ready > streaming.upto:
            streaming.reduce_to(ready)
    return streaming


def _verifier(tmp_path: Path, name: str) -> Verifier:
    policy = TrustPolicy(aggregator=name, aggregator_params=PARAMS.get(name, {}), max_share=1.0)
    return Verifier(policy, tmp_path / f"{name}.db", ME)


@pytest.mark.parametrize("codec", ["none", "int8", "fp16", "int4"])
@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_a_streamed_reduction_is_bitwise_the_whole_vector_one_for_every_aggregator(
    tmp_path: Path, name: str, codec: str
) -> None:
    vectors = _vectors(seed=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference_verifier = _verifier(tmp_path / "a", name)
    streaming_verifier = _verifier(tmp_path / "b", name)
    try:
        contributions = _contributions(vectors, codec)
        reference = reference_verifier.reducer.reduce(3, 0, 0, contributions)
        streaming = _stream(vectors, codec, streaming_verifier.reducer.stream_plan, seed=2)
        prefix = streaming.prefix()
        if name in COORDINATEWISE:
            assert prefix is not None and prefix.upto == NUMEL  # every block was streamed
        else:
            assert prefix is None  # needs whole vectors: reduced once all are in
        result = streaming_verifier.reducer.reduce(3, 0, 0, contributions, prefix=prefix)
        assert torch.equal(result.vector, reference.vector)
        assert result.used == reference.used
        if prefix is not None:
            assert result.vector is prefix.out  # the streamed values are the result
    finally:
        reference_verifier.close()
        streaming_verifier.close()


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_weighted_mean_streams_bitwise_too(codec: str) -> None:
    vectors = _vectors(seed=3)
    contributions = _contributions(vectors, codec)
    reference = weighted_mean_reducer(3, 0, 0, contributions)
    streaming = _stream(vectors, codec, lambda r, m: weighted_mean_plan(r, m), seed=4)
    prefix = streaming.prefix()
    assert prefix is not None and prefix.upto == NUMEL
    result = weighted_mean_reducer(3, 0, 0, contributions, prefix=prefix)
    assert result.vector is prefix.out
    assert torch.equal(result.vector, reference.vector)


def test_a_member_refused_by_screening_at_the_end_makes_the_owner_start_over(
    tmp_path: Path,
) -> None:
    vectors = _vectors(seed=5, outlier=50.0)  # p3's update is 50x everyone else's
    verifier = _verifier(tmp_path, "mean")
    try:
        streaming = _stream(vectors, "none", verifier.reducer.stream_plan, seed=6)
        prefix = streaming.prefix()
        assert prefix is not None and prefix.upto == NUMEL  # p3 was in every block
        contributions = _contributions(vectors, "none")
        result = verifier.reducer.reduce(3, 0, 0, contributions, prefix=prefix)
        assert "p3" in result.rejected and "p3" not in result.used
        assert result.vector is not prefix.out
        kept = [c for c in contributions if c.peer != "p3"]
        expected = aggregate("mean", [c.vector for c in kept], [c.weight for c in kept])
        assert torch.equal(result.vector, expected.vector)
    finally:
        verifier.close()


def test_a_member_that_stops_mid_part_costs_only_its_contribution() -> None:
    vectors = _vectors(seed=7)
    streaming = _stream(vectors, "none", lambda r, m: weighted_mean_plan(r, m), seed=8, stall="p2")
    prefix = streaming.prefix()
    assert prefix is not None and 0 < prefix.upto < NUMEL  # stuck where p2 stopped
    # the deadline passes: the reduction runs over the parts that came in full
    kept = _contributions(vectors, "none", [p for p in PEERS if p != "p2"])
    result = weighted_mean_reducer(3, 0, 0, kept, prefix=prefix)
    assert result.vector is not prefix.out
    assert torch.equal(result.vector, weighted_mean_reducer(3, 0, 0, kept).vector)


def test_refused_values_or_a_detached_member_give_the_streamed_blocks_up() -> None:
    vectors = _vectors(seed=9)
    vectors["p1"][5_000] = float("nan")
    streaming = StreamingReduction(NUMEL, (ME, vectors[ME]), block=BLOCK)
    raw = vectors["p1"].numpy().tobytes()
    assert streaming.attach("p1", codecs.Encoded("none", NUMEL, 256, raw))
    assert not streaming.attach("p1", codecs.Encoded("none", NUMEL, 256, raw))  # once
    assert not streaming.attach("p9", codecs.Encoded("none", 7, 256, bytes(28)))  # size
    streaming.start(weighted_mean_plan(3, [(ME, 1.0), ("p1", 1.0)]))  # type: ignore[arg-type]
    streaming.arrived("p1", 4 * 4_096)
    assert streaming.ready() == 4_096  # whole blocks only
    streaming.reduce_to(streaming.ready())
    assert streaming.upto == 4_096 and not streaming.broken
    streaming.arrived("p1", len(raw))
    streaming.reduce_to(streaming.ready())  # the NaN is in the next block
    assert streaming.broken and streaming.prefix() is None and streaming.ready() == 0

    other = StreamingReduction(NUMEL, (ME, vectors[ME]), block=BLOCK)
    other.attach("p2", codecs.Encoded("none", NUMEL, 256, vectors["p2"].numpy().tobytes()))
    other.start(weighted_mean_plan(3, [(ME, 1.0), ("p2", 1.0)]))  # type: ignore[arg-type]
    other.detach("p2")  # its stream broke: its buffer is not read again
    assert other.broken and other.prefix() is None
    with pytest.raises(ValueError, match="not attached"):
        StreamingReduction(NUMEL, (ME, vectors[ME])).start(
            weighted_mean_plan(3, [(ME, 1.0), ("p5", 1.0)])  # type: ignore[arg-type]
        )


def test_ready_values_follow_the_payload_layout() -> None:
    assert codecs.ready_values(1_000, "none", 256, 4 * 999 + 3) == 999
    assert codecs.ready_values(1_000, "fp16", 256, 2 * 500) == 500
    scales = 4 * 4  # four blocks of 256 values
    assert codecs.ready_values(1_000, "int8", 256, scales - 1) == 0  # scales come first
    assert codecs.ready_values(1_000, "int8", 256, scales + 10) == 10
    assert codecs.ready_values(1_000, "int4", 256, scales + 10) == 20
    assert codecs.ready_values(1_000, "int4", 256, scales + 500) == 1_000


@pytest.mark.parametrize("codec", codecs.DENSE)
def test_a_range_decodes_to_exactly_the_whole_payloads_values(codec: str) -> None:
    values = torch.randn(3_001)
    enc = codecs.encode(values, codec, block_size=64)
    enc = codecs.Encoded.from_meta(enc.meta(), bytes(enc.payload), max_numel=3_001)
    whole = codecs.decode(enc)
    for lo, hi in [(0, 3_001), (0, 1), (1, 64), (63, 129), (1_000, 3_001), (3_000, 3_001), (7, 7)]:
        assert torch.equal(codecs.decode_range(enc, lo, hi), whole[lo:hi])
    with pytest.raises(ValueError, match="range"):
        codecs.decode_range(enc, 10, 3_002)


def test_a_range_with_a_bad_code_or_value_is_refused() -> None:
    enc = codecs.encode(torch.randn(512), "int8", block_size=256)
    payload = bytearray(enc.payload)
    payload[8 + 300] = 0x80  # code -128 in the second block
    bad = codecs.Encoded.from_meta(enc.meta(), bytes(payload), max_numel=512)
    assert codecs.decode_range(bad, 0, 256).numel() == 256  # the first block is fine
    with pytest.raises(codecs.CodecError, match="-128"):
        codecs.decode_range(bad, 256, 512)
    raw = torch.ones(16)
    raw[3] = float("inf")
    inf = codecs.Encoded("none", 16, 256, raw.numpy().tobytes())
    assert torch.equal(codecs.decode_range(inf, 4, 16), torch.ones(12))
    with pytest.raises(codecs.CodecError, match="inf or NaN"):
        codecs.decode_range(inf, 0, 4)


@pytest.mark.parametrize("name", sorted(COORDINATEWISE))
def test_coordinatewise_aggregators_give_each_block_of_the_whole_result(name: str) -> None:
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(70_001, generator=g) for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    whole = aggregate(name, rows, weights, PARAMS.get(name)).vector
    for lo, hi in [(0, 7), (7, 1_031), (1_031, 65_541), (65_541, 70_001)]:
        part = aggregate(name, [r[lo:hi] for r in rows], weights, PARAMS.get(name)).vector
        assert torch.equal(part, whole[lo:hi])
