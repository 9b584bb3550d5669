"""The wall-clock round schedule, by hand."""

from __future__ import annotations

import time

from node.train.clock import SecondsClock


def test_sync_times_spread_fragments_evenly_over_each_round() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=4)
    assert [clock.sync_time(1, f) for f in range(4)] == [1005.0, 1010.0, 1015.0, 1020.0]
    assert clock.sync_time(3, 0) == 1045.0


def test_round_at() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=2)
    assert clock.round_at(999.9) == 0
    assert clock.round_at(1000.0) == 1
    assert clock.round_at(1019.99) == 1
    assert clock.round_at(1020.0) == 2


def test_due_lists_every_passed_sync_after_the_last_one_in_order() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=2)
    assert clock.due(1009.0, (0, 1)) == []
    assert clock.due(1010.0, (0, 1)) == [(1, 0)]
    assert clock.due(1031.0, (1, 0)) == [(1, 1), (2, 0)]
    assert clock.due(1031.0, (2, 0)) == []


def test_start_time_is_a_whole_second_at_least_the_lead_ahead() -> None:
    now = time.time()
    t0 = SecondsClock.start_time(20.0, lead=5.0)
    assert t0 == int(t0) and now + 5.0 <= t0 <= time.time() + 6.0


# ---- whose round clock a node takes ----------------------------------------------------


def _manifest(identity, t0: float = 1000.0, length: float = 10.0, spec: str = "s" * 64) -> bytes:
    from protocol.wire.messages import Header, seal

    header = Header("manifest", "run-c", 0, 0, 0, identity.peer_id)
    return seal(identity, header, {"t0": t0, "round_seconds": length, "spec": spec})


def _settings(*signers: str):
    from node.train.clock import ClockSettings

    return ClockSettings("run-c", "s" * 64, 10.0, 2, signers=frozenset(signers))


def test_a_clock_is_taken_only_from_a_trusted_signer_with_the_runs_round_length() -> None:
    import pytest

    from node.train.clock import _check
    from protocol.errors import ProtocolError
    from verification.identity import Identity

    first, me, outsider = Identity.generate(), Identity.generate(), Identity.generate()
    trusted = _settings(first.peer_id)
    assert _check(_manifest(first), first.peer_id, trusted, me.peer_id) == (1000.0, 10.0)
    assert _check(_manifest(me), me.peer_id, trusted, me.peer_id) == (1000.0, 10.0)  # own
    cases = [
        (_manifest(outsider), outsider.peer_id, "untrusted_signer"),
        (_manifest(first, length=1.0), first.peer_id, "wrong_round_seconds"),
        (_manifest(first, spec="t" * 64), first.peer_id, "spec_mismatch"),
        (_manifest(first, t0=float("nan")), first.peer_id, "malformed"),
        (_manifest(outsider), first.peer_id, "sender"),  # stored under another's subkey
    ]
    for value, signer, reason in cases:
        with pytest.raises(ProtocolError) as info:
            _check(value, signer, trusted, me.peer_id)
        assert reason in str(info.value), (reason, str(info.value))


def test_clock_signers_default_to_the_initial_peers() -> None:
    from node.config import load_config
    from node.settings import clock_settings
    from verification.identity import Identity

    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    peers = (f"/ip4/10.0.0.1/tcp/31337/p2p/{a}", f"/ip4/10.0.0.2/tcp/31337/p2p/{b}")
    cfg = load_config(None, ["sync.round_seconds=20"])
    settings = clock_settings(cfg, "d" * 64, 2, peers, None)
    assert settings.signers == {a, b} and settings.round_seconds == 20.0 and settings.wait > 0
    named = load_config(None, [f"run.clock_signers=['{b}']"])
    assert clock_settings(named, "d" * 64, 2, peers, None).signers == {b}
    first = clock_settings(cfg, "d" * 64, 2, (), None)
    assert first.signers == frozenset() and first.wait == 0.0  # the first node trusts itself


def test_an_untrusted_manifest_of_the_trusted_clock_is_said_at_info_another_at_warning(
    caplog,
) -> None:
    import asyncio
    import logging

    from node.train.clock import _read
    from verification.identity import Identity

    first, me, peer, outsider = (Identity.generate() for _ in range(4))

    class _DHT:
        async def dht_get(self, key: str, **_: object) -> dict[str, bytes]:
            return {
                first.peer_id: _manifest(first, t0=1000.0),
                peer.peer_id: _manifest(peer, t0=1000.0),  # a node of the run, same clock
                outsider.peer_id: _manifest(outsider, t0=10.0),  # an earlier, other clock
            }

    refused: dict[str, str] = {}
    settings = _settings(first.peer_id)
    with caplog.at_level(logging.INFO, logger="node.train.clock"):
        found = asyncio.run(_read(_DHT(), settings, me.peer_id, refused))  # type: ignore[arg-type]
        asyncio.run(_read(_DHT(), settings, me.peer_id, refused))  # type: ignore[arg-type]
    assert found == (1000.0, 10.0, first.peer_id)
    said = {(r.levelno, r.getMessage().split()[3]) for r in caplog.records}
    assert said == {(logging.INFO, peer.peer_id), (logging.WARNING, outsider.peer_id)}
    assert len(caplog.records) == 2  # once each
