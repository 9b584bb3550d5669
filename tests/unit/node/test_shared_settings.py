"""The settings every node of a run shares: one digest for the same shared values,
whatever each node's own settings."""

from __future__ import annotations

import dataclasses

from node.config import AtollConfig, load_config
from node.shared_settings import (
    SHARED_KEYS,
    canonical,
    same_value,
    settings_digest,
    shared_settings,
)


def test_every_shared_key_is_a_key_of_the_config() -> None:
    data = AtollConfig().to_dict()
    for section, keys in SHARED_KEYS.items():
        assert set(keys) <= set(data[section]), section
    assert {f.name for f in dataclasses.fields(AtollConfig)} >= set(SHARED_KEYS)


def test_local_settings_leave_the_digest_and_shared_ones_change_it() -> None:
    base = settings_digest(load_config(None, []))
    assert len(base) == 64
    assert settings_digest(load_config(None, ["train.lr=0.01"])) == base
    assert settings_digest(load_config(None, ["run.data_dir='/elsewhere'"])) == base
    assert settings_digest(load_config(None, ["sync.codec='int4'"])) != base
    assert settings_digest(load_config(None, ["trust.aggregator='median'"])) != base


def test_shared_values_are_canonical() -> None:
    assert canonical({"b": (1, {"d": 2, "c": 3}), "a": [()]}) == {
        "a": [[]],
        "b": [1, {"c": 3, "d": 2}],
    }
    assert list(canonical({"z": 1, "a": 2})) == ["a", "z"]
    shared = shared_settings(load_config(None, []))
    assert set(shared) == set(SHARED_KEYS)
    assert shared["run"] == {"run_id": shared["run"]["run_id"], "seed": 0, "spec_signers": []}


def test_values_are_compared_once_validated() -> None:
    assert same_value("outer", "lr", 1, 1.0)
    assert not same_value("outer", "lr", 0.7, 0.8)
    assert not same_value("sync", "codec", "int8", "int9")  # not a codec at all
