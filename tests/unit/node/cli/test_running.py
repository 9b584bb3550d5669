"""``atoll simulate``, ``atoll run`` and ``atoll swarm``: their options checked before
anything starts."""

from __future__ import annotations

import argparse

import pytest

from node.cli import main
from node.cli.running import _swarm_spec, initial_peers
from node.config import ConfigError

PEER = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_initial_peers_follow_the_config_rules() -> None:
    assert initial_peers([PEER]) == (PEER,)
    assert initial_peers([]) == ()
    with pytest.raises(ConfigError, match="--initial-peers: .* needs its peer id"):
        initial_peers(["/ip4/203.0.113.5/tcp/31337"])


def _swarm_args(**given) -> argparse.Namespace:
    options = {
        "nodes": 4,
        "config": None,
        "overrides": [],
        "dir": "swarm-dir",
        "rounds": 3,
        "procs_per_node": 1,
        "byzantine": None,
        "slowdowns": None,
    }
    return argparse.Namespace(**{**options, **given})


def test_a_swarm_spec_places_faults_and_slowdowns_on_the_last_nodes() -> None:
    spec = _swarm_args(byzantine="sign_flip:2", slowdowns="1,1,2,4")
    made = _swarm_spec(spec, max_rounds=10)
    assert made.nodes == 4 and made.rounds == 3 and str(made.directory) == "swarm-dir"
    assert made.extra_args[2] == ["--byzantine", "sign_flip", "--slowdown", "2.0"]
    assert made.extra_args[0] == ["--slowdown", "1.0"]
    assert _swarm_spec(_swarm_args(rounds=None), max_rounds=10).rounds == 10


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"nodes": 0}, "--nodes must be >= 1"),
        ({"procs_per_node": 0}, "--procs-per-node must be >= 1"),
        ({"byzantine": "polite"}, "--byzantine 'polite'"),
        ({"byzantine": "scale:4"}, "0 < K < --nodes"),
        ({"slowdowns": "1,2"}, "one factor >= 1 per node"),
    ],
)
def test_swarm_options_are_checked_before_anything_starts(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _swarm_spec(_swarm_args(**given), max_rounds=10)


def test_a_bad_config_stops_a_command_before_it_starts(capsys) -> None:
    assert main(["simulate", "--set", "sync.codec='int9'"]) == 2
    assert main(["run", "--set", "sync.codec='int9'"]) == 2
    err = capsys.readouterr().err
    assert err.count("sync.codec") == 2 and "Traceback" not in err
