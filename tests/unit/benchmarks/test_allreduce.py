"""The all-reduce benchmark's pure parts: its sizes per method and the codec rows' checks."""

from __future__ import annotations

import pytest
import torch

from benchmarks import _allreduce_codecs as codec_rows
from benchmarks import allreduce
from protocol.wire import codec as codecs

_N = 3 * 4096 + 1000  # a short last chunk


def _inputs(peers: int = 3) -> list[torch.Tensor]:
    return [torch.randn(_N, generator=torch.Generator().manual_seed(i)) for i in range(peers)]


def _owner_result(mean: torch.Tensor, codec: str) -> torch.Tensor:
    """What the owners answer for ``codec``'s parts, decoded (one owner, the whole vector)."""
    args = codec_rows.CODEC_ARGS[codec]
    if codec == "topk":
        enc = codecs.encode(mean, "sparse", block_size=args["block_size"], bits=8)
    else:
        enc = codecs.encode(mean, "int8", block_size=args["block_size"])
    return codecs.decode(enc, expected_numel=mean.numel())


def test_codec_rows_run_at_both_sizes_in_quick_mode_and_the_others_at_one():
    assert allreduce.method_sizes("topk_p2pd", quick=True) == [10_000_000, 50_000_000]
    assert allreduce.method_sizes("int8_direct", quick=True) == [10_000_000, 50_000_000]
    assert allreduce.method_sizes("atoll", quick=True) == [10_000_000]
    assert allreduce.method_sizes("atoll", quick=False) == [10_000_000, 50_000_000]
    assert all(allreduce.method_sizes(m, True, smoke=True) == [20_000] for m in allreduce._METHODS)


def test_codec_settings_match_the_encode_arguments():
    assert codec_rows.settings_args("topk") == {
        "codec": "topk",
        "block_size": 4096,
        "topk_k": 41,
        "topk_bits": 2,
    }
    assert codec_rows.settings_args("int8") == {"codec": "int8", "block_size": 256}
    kept = codec_rows.roundtrip(_inputs(1)[0], "topk")
    per_chunk = torch.nn.functional.pad(kept != 0, (0, -_N % 4096)).view(-1, 4096).sum(1)
    assert per_chunk.tolist() == [41] * 4


def test_expected_is_the_mean_of_the_decoded_inputs_and_the_union_of_their_supports():
    inputs = _inputs()
    mean, support = codec_rows.expected(inputs, "topk")
    decoded = [codec_rows.roundtrip(v, "topk") for v in inputs]
    torch.testing.assert_close(mean, torch.stack(decoded).mean(0))
    assert torch.equal(support, torch.stack([d != 0 for d in decoded]).any(0))
    assert codec_rows.expected(inputs, "int8")[1] is None


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_the_owners_result_passes_and_a_wrong_one_fails(codec):
    mean, support = codec_rows.expected(_inputs(), codec)
    result = _owner_result(mean, codec)
    good = codec_rows.check(result, mean, support, codec)
    assert good["bound_ratio"] <= 1 and good["support_ok"], good
    # a result 1 % off, or one step off in one chunk, is beyond half a step
    assert codec_rows.check(result * 1.01, mean, support, codec)["bound_ratio"] > 1
    nudged = result.clone()
    i = int(result.abs().argmax())
    nudged[i] -= mean[i].sign() * mean.abs().max() / 127
    assert codec_rows.check(nudged, mean, support, codec)["bound_ratio"] > 1
    verdict = codec_rows.verdict([good, codec_rows.check(nudged, mean, support, codec)])
    assert verdict["correct"] is False


def test_a_topk_result_off_the_union_of_supports_fails():
    mean, support = codec_rows.expected(_inputs(), "topk")
    result = _owner_result(mean, "topk")
    result[int((~support).nonzero()[0])] = 1e-9  # within the bound, outside the support
    checked = codec_rows.check(result, mean, support, "topk")
    assert checked["bound_ratio"] <= 1 and not checked["support_ok"]
    assert codec_rows.verdict([checked])["correct"] is False


def test_ratios_put_topk_over_int8_per_plane():
    def row(seconds: float | None, sent: int) -> dict:
        return {"10000000": {"median_s": seconds, "bytes_sent_per_peer": sent}}

    results = {
        "int8_p2pd": row(2.0, 1000),
        "topk_p2pd": row(0.5, 50),
        "int8_direct": row(1.0, 1000),
        "topk_direct": row(None, 0),  # a method that failed
    }
    out = codec_rows.ratios(results)
    assert out["topk_vs_int8_p2pd"] == {"10000000": 0.25}
    assert out["bytes_topk_vs_int8_p2pd"] == {"10000000": 0.05}
    assert out["topk_vs_int8_direct"] == {"10000000": None}
    assert out["bytes_topk_vs_int8_direct"] == {"10000000": None}
