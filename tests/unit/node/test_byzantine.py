"""Fault injection for tests and benchmarks: each mode corrupts what a node sends in its
one way, and an honest node's behaviour is untouched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.byzantine import make_behaviour, training_data
from protocol.averaging.parts import FaultInjection
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import open_part
from verification.identity import Identity, verify

ME = Identity.from_seed(b"z" * 32)
VECTOR = torch.tensor([1.0, -2.0, 3.0, -4.0])


def _request(mode: str, round_: int = 1):
    behaviour = make_behaviour(mode)
    header = Header("part", "run", round_, 0, 0, ME.peer_id)
    meta = {"content": "update", "weight": 5}
    return behaviour.request(ME, header, meta, codecs.encode(VECTOR, "none"))


def test_honest_is_the_default_and_an_unknown_mode_is_named() -> None:
    assert type(make_behaviour(None)) is FaultInjection
    assert type(make_behaviour("honest")) is FaultInjection
    with pytest.raises(ValueError, match="expected one of sign_flip"):
        make_behaviour("polite")


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("sign_flip", [-1.0, 2.0, -3.0, 4.0]),
        ("scale", [50.0, -100.0, 150.0, -200.0]),
        ("zero", [0.0, 0.0, 0.0, 0.0]),
        ("alie", [0.0, -4.0, 0.0, -8.0]),
        ("ipm", [-0.5, 1.0, -1.5, 2.0]),
    ],
)
def test_vector_attacks_by_hand(mode: str, expected: list[float]) -> None:
    out = make_behaviour(mode).contribution(1, 0, VECTOR)
    torch.testing.assert_close(out, torch.tensor(expected))


def test_noise_is_large_next_to_the_update_and_seeded() -> None:
    a = make_behaviour("noise", seed=1).contribution(1, 0, VECTOR)
    b = make_behaviour("noise", seed=1).contribution(1, 0, VECTOR)
    assert torch.equal(a, b) and (a - VECTOR).norm() > 3 * VECTOR.norm()


def test_wire_attacks_break_the_rule_a_receiver_checks() -> None:
    honest = _request("honest")
    forged = _request("bad_signature")
    assert not verify(ME.peer_id, b"atoll/part/v1\0" + forged.digest, forged.signature)
    inflated = open_part(_request("inflated_tokens").to_bytes(), max_bytes=1 << 20)
    assert inflated.meta["weight"] == 10**12
    longer = open_part(_request("wrong_shape").to_bytes(), max_bytes=1 << 20)
    assert longer.body.nbytes == honest.body.nbytes + 4
    nan = open_part(_request("nan").to_bytes(), max_bytes=1 << 20)
    assert torch.frombuffer(bytearray(nan.body), dtype=torch.float32)[0].isnan()


def test_a_replay_resends_the_first_part_in_every_later_round() -> None:
    behaviour = make_behaviour("replay")
    header = Header("part", "run", 1, 0, 0, ME.peer_id)
    first = behaviour.request(ME, header, {"content": "update"}, codecs.encode(VECTOR, "none"))
    header5 = Header("part", "run", 5, 0, 0, ME.peer_id)
    later = behaviour.request(ME, header5, {"content": "update"}, codecs.encode(2 * VECTOR, "none"))
    assert later is first


class _Commitments:
    def __init__(self) -> None:
        self.made: list[tuple[tuple, dict]] = []

    async def commit(self, round_, fragment, group, digests, content="update") -> None:
        self.made.append((tuple(group), dict(digests)))


def test_commit_attacks_skip_or_equivocate() -> None:
    digests = {0: b"d" * 32}
    skipped, twice = _Commitments(), _Commitments()
    asyncio.run(make_behaviour("skip_commit").commit(skipped, 1, 0, ["a"], digests))
    asyncio.run(make_behaviour("equivocate").commit(twice, 1, 0, ["a"], digests))
    assert skipped.made == []
    (first_group, first), (second_group, second) = twice.made
    assert first != second and second == digests and second_group == ("a",)


def test_owner_attacks_forge_inputs_or_wreck_the_result() -> None:
    meta = make_behaviour("bad_owner").reduced_meta({"digests": [b"a" * 32]})
    assert meta["digests"] != [b"a" * 32]
    wrecked = make_behaviour("malicious_owner").reduced(torch.ones(2))
    assert wrecked.tolist() == [-11.0, -11.0]
    assert make_behaviour("silent").silent


def test_random_data_replaces_the_bytes_a_node_trains_on() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    assert training_data(None, data) is data
    noise = training_data("random_data", data, seed=3)
    assert noise.shape == data.shape and not torch.equal(noise, data)
    assert torch.equal(noise, training_data("random_data", data, seed=3))
