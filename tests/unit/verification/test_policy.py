"""Tests for verification.policy: defaults, the shipped trust configs, validation, decisions."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pydantic
import pytest

from verification.identity import Identity
from verification.policy import TrustPolicy, is_peer_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 ships no tomllib
    import tomli as tomllib

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "trust"

A = "12D3KooWHgyZUJG4T1EYya9zZQ6VAoBD4Ws4Adut9bUpVmLMRXg2"
B = "12D3KooWKp4wDcx1te8zPS5J8UFKjE3wLHTYrmZQeDxFkkLkhJKQ"
LEGACY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
STRANGER = Identity.from_seed(bytes(32)).peer_id


def _load(name: str) -> TrustPolicy:
    data = tomllib.loads((CONFIGS / name).read_text())
    assert set(data) == {"trust"}, f"{name} must hold only a [trust] table"
    return TrustPolicy(**data["trust"])


def _error_fields(error: pydantic.ValidationError) -> set[str]:
    return {".".join(str(part) for part in item["loc"]) for item in error.errors()}


def test_defaults() -> None:
    policy = TrustPolicy()
    assert (policy.allow, policy.deny, policy.accept_unknown) == ((), (), True)
    assert (policy.aggregator, policy.aggregator_params) == ("mean", {})
    assert (policy.screening, policy.norm_kappa, policy.min_cosine) == (True, 3.0, -0.1)
    assert (policy.max_tokens, policy.max_share) == (10**9, 1.0)
    assert (policy.on_violation, policy.quarantine_rounds) == ("quarantine", 5)
    assert (policy.min_reputation, policy.violations_to_ban) == (0.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.screening = False  # type: ignore[misc]


def test_strict_config() -> None:
    policy = _load("strict.toml")
    assert policy.screening and policy.accept_unknown
    assert (policy.aggregator, policy.aggregator_params) == ("trimmed_mean", {"trim": 0.2})
    assert (policy.norm_kappa, policy.min_cosine, policy.max_share) == (2.5, 0.0, 0.5)
    assert (policy.on_violation, policy.quarantine_rounds) == ("quarantine", 10)
    assert (policy.violations_to_ban, policy.min_reputation) == (3, 0.3)


def test_open_config() -> None:
    policy = _load("open.toml")
    assert policy.screening and policy.accept_unknown
    assert policy.aggregator == "centered_clip"
    assert (policy.on_violation, policy.quarantine_rounds, policy.violations_to_ban) == (
        "quarantine",
        3,
        0,
    )


def test_allow_list_config() -> None:
    policy = _load("allow-list.toml")
    assert not policy.accept_unknown
    assert len(policy.allow) == 2 and all(is_peer_id(peer) for peer in policy.allow)
    assert (policy.aggregator, policy.on_violation) == ("median", "ban")
    assert policy.admits(policy.allow[0]) == (True, "")
    assert policy.admits(STRANGER) == (False, "not_allowed")


def test_allow_list_examples_are_marked() -> None:
    text = (CONFIGS / "allow-list.toml").read_text()
    assert "EXAMPLES ONLY" in text and text.count("replace") >= 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"aggregtor": "mean"}, "aggregtor"),
        ({"aggregator": "avg"}, "aggregator"),
        ({"on_violation": "shame"}, "on_violation"),
        ({"norm_kappa": 1.0}, "norm_kappa"),
        ({"norm_kappa": float("inf")}, "norm_kappa"),
        ({"min_cosine": 1.5}, "min_cosine"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_share": 0.0}, "max_share"),
        ({"quarantine_rounds": 0}, "quarantine_rounds"),
        ({"min_reputation": -0.1}, "min_reputation"),
        ({"violations_to_ban": -1}, "violations_to_ban"),
        ({"aggregator_params": {"trim": float("nan")}}, "aggregator_params"),
        ({"allow": [A, "not-a-peer"]}, "allow"),
        ({"deny": ["12D3KooW" + "0" * 44]}, "deny"),  # 0 is not in the base58 alphabet
        ({"deny": ["12D3KooW" + "a" * 60]}, "deny"),  # too long
        ({"deny": ["Xm" + "a" * 44]}, "deny"),  # wrong prefix
    ],
)
def test_validation_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        TrustPolicy(**kwargs)
    assert field in _error_fields(info.value)


def test_bad_peer_id_error_names_the_entry() -> None:
    with pytest.raises(ValueError, match=r"entry 1 \('not-a-peer'\) is not a libp2p PeerID"):
        TrustPolicy(allow=(A, "not-a-peer"))


def test_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match=f"allow and deny overlap: {B}"):
        TrustPolicy(allow=(A, B), deny=(B,))


def test_closed_policy_without_allow_list_is_refused() -> None:
    with pytest.raises(ValueError, match="admits no peer"):
        TrustPolicy(accept_unknown=False)


def test_peer_id_shapes() -> None:
    assert is_peer_id(A) and is_peer_id(LEGACY) and is_peer_id(STRANGER)
    assert not is_peer_id("") and not is_peer_id(A[:40]) and not is_peer_id(A.replace("W", "l"))


@pytest.mark.parametrize(
    ("allow", "deny", "accept_unknown", "expected"),
    [
        # peer A on the allow list
        ((A,), (), True, (True, "")),
        ((A,), (), False, (True, "")),
        # peer A on the deny list: denied whatever accept_unknown says
        ((), (A,), True, (False, "denied")),
        ((B,), (A,), False, (False, "denied")),
        # peer A on neither list
        ((), (), True, (True, "")),
        ((B,), (), True, (True, "")),
        ((B,), (), False, (False, "not_allowed")),
        ((B,), (LEGACY,), False, (False, "not_allowed")),
    ],
)
def test_admits_truth_table(
    allow: tuple[str, ...], deny: tuple[str, ...], accept_unknown: bool, expected: tuple
) -> None:
    policy = TrustPolicy(allow=allow, deny=deny, accept_unknown=accept_unknown)
    assert policy.admits(A) == expected


@pytest.mark.parametrize(
    ("on_violation", "violations_to_ban", "expected"),
    [
        ("drop", 0, ["drop", "drop", "drop", "drop"]),
        ("quarantine", 0, ["quarantine"] * 4),
        ("quarantine", 3, ["quarantine", "quarantine", "ban", "ban"]),
        ("drop", 1, ["ban"] * 4),
        ("ban", 0, ["ban"] * 4),
        ("ban", 3, ["ban"] * 4),
    ],
)
def test_action_for_escalates(on_violation: str, violations_to_ban: int, expected: list) -> None:
    policy = TrustPolicy(on_violation=on_violation, violations_to_ban=violations_to_ban)
    assert [policy.action_for(n) for n in (1, 2, 3, 4)] == expected


def test_action_for_refuses_negative_counts() -> None:
    with pytest.raises(ValueError, match="violations"):
        TrustPolicy().action_for(-1)


@pytest.mark.parametrize("name", ["strict.toml", "open.toml", "allow-list.toml"])
def test_config_aggregator_runs(name: str) -> None:
    # The policy passes aggregator_params through unchecked; the aggregator checks them.
    aggregators = pytest.importorskip("verification.aggregators")
    torch = pytest.importorskip("torch")
    policy = _load(name)
    vectors = [torch.full((4,), float(i)) for i in range(5)]
    result = aggregators.aggregate(policy.aggregator, vectors, [1.0] * 5, policy.aggregator_params)
    assert result.vector.shape == (4,)
