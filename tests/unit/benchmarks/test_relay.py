"""The relay benchmark's measure of a row, from its nodes' sync events."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from benchmarks.relay import _measure


def _node(tmp_path: Path, name: str, me: str, syncs: list[tuple[int, list[str], float]]):
    folder = tmp_path / name
    folder.mkdir()
    with (folder / "events.jsonl").open("w") as f:
        for round_, owners, seconds in syncs:
            event = {"event": "sync", "round": round_, "owners": owners, "complete": True}
            f.write(json.dumps({**event, "seconds": seconds}) + "\n")
    status = {"peer_id": me, "reachability": {"status": "relayed"}}
    return SimpleNamespace(data_dir=folder, status=status, proc=SimpleNamespace(returncode=0))


def test_exchanges_are_timed_from_the_round_both_volunteers_own_parts(tmp_path: Path) -> None:
    r, v1, v2 = "12D3KooWr", "12D3KooWv1", "12D3KooWv2"
    nodes = [
        _node(tmp_path, "r", r, [(1, [r], 0.1)]),
        _node(tmp_path, "v1", v1, [(1, [r], 9.0), (2, [r, v1], 9.0), (3, [r, v1, v2], 1.0)]),
        _node(tmp_path, "v2", v2, [(1, [r], 9.0), (3, [r, v1, v2], 3.0), (4, [v2], 2.0)]),
    ]
    got = _measure(nodes, {"r": 10, "v1": 5, "v2": 5}, {"r": 4, "v1": 2, "v2": 2})
    assert got["owned_rounds"] == {v1: [2, 3], v2: [3, 4]}
    # from round 3 (the later volunteer's first): 1.0, 3.0 and 2.0 seconds
    assert got["summary"]["volunteers_own_from_round"] == 3
    assert got["summary"]["exchanges_measured"] == 3
    assert got["summary"]["exchange_s_median"] == 2.0
    assert got["summary"]["relay_link_bytes"] == 10
    assert got["summary"]["relay_link_bytes_late"] == 4 and got["bytes_from_round"]["r"] == 4
