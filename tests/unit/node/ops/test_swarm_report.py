"""What a local swarm did, read from its nodes' own files: agreement and bits per byte
over the honest nodes, the one-paragraph summary and the live table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from node.config import load_config
from node.ops.swarm_report import SwarmProcess, summarize
from node.ops.swarm_view import dump_json, format_summary, render_table


def _node(tmp_path: Path, index: int, digests: list[str], **status) -> SwarmProcess:
    folder = tmp_path / f"node{index}"
    folder.mkdir()
    events = [
        {"event": "round", "round": r + 1, "global_digest": d, "val_bpb": 3.0 - r, "t": 10.0 * r}
        for r, d in enumerate(digests)
    ]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    defaults = {"peer_id": f"peer{index}", "val_bpb_start": 4.0, "bytes_sent": 2**20}
    (folder / "status.json").write_text(json.dumps({**defaults, **status}))
    proc = SimpleNamespace(returncode=0, poll=lambda: 0)
    return SwarmProcess(index, folder, proc, None)  # type: ignore[arg-type]


def test_honest_nodes_that_hold_the_same_state_every_round_agree(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, i, ["aa", "bb"], params=1000, steps=20) for i in range(2)]
    summary = summarize(nodes, load_config(None, []))
    assert summary["nodes"] == 2 and summary["rounds"] == 2
    assert summary["params_agree"] and summary["rounds_disagreeing"] == []
    assert summary["val_bpb_start"] == 4.0 and summary["val_bpb_end"] == 2.0
    assert summary["ddp_bytes_per_node"] == [20 * 1000 * 4, 20 * 1000 * 4]  # 2(N-1)/N = 1
    assert summary["round_seconds"] == [10.0, 10.0] and summary["exit_codes"] == [0, 0]


def test_a_faulty_node_is_listed_but_not_averaged_in(tmp_path: Path) -> None:
    honest = [_node(tmp_path, i, ["aa", "bb"]) for i in range(2)]
    faulty = _node(tmp_path, 2, ["xx", "yy"])
    assert not summarize(honest + [faulty], load_config(None, []))["params_agree"]
    summary = summarize(honest + [faulty], load_config(None, []), byzantine=[2])
    assert summary["params_agree"] and summary["byzantine_nodes"] == [2]
    assert summary["peer_ids"] == ["peer0", "peer1", "peer2"]


def test_a_round_on_which_nodes_differ_is_named(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, 0, ["aa", "bb"]), _node(tmp_path, 1, ["aa", "cc"])]
    summary = summarize(nodes, load_config(None, []))
    assert not summary["params_agree"] and summary["rounds_disagreeing"] == [2]


def test_the_summary_reads_as_one_paragraph_and_one_json_line(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, i, ["aa"], params=1000, steps=10) for i in range(2)]
    summary = summarize(nodes, load_config(None, []))
    summary.update(seconds=12.0, directory=str(tmp_path))
    text = format_summary(summary)
    assert text.startswith("swarm of 2 nodes, 1 rounds in 12s; val bits/byte 4.000 -> 3.000")
    assert "params agree: True" in text and f"logs and checkpoints: {tmp_path}" in text
    line = dump_json(summary)
    assert "\n" not in line and json.loads(line)["rounds"] == 1


def test_a_node_that_failed_is_named_with_the_end_of_its_log(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, i, ["aa"], params=1000, steps=10) for i in range(3)]
    lines = [f"line {i}" for i in range(20)] + ["RuntimeError: the site's process group broke"]
    (nodes[1].data_dir / "node.log").write_text("\n".join(lines) + "\n")
    nodes[1].proc.returncode = 1
    nodes[2].proc.returncode = None  # still running: not a failure
    summary = summarize(nodes, load_config(None, []))
    assert summary["exit_codes"] == [0, 1, None]
    assert summary["failed_nodes"] == {"1": lines[-8:]}
    summary.update(seconds=12.0, directory=str(tmp_path))
    text = format_summary(summary)
    assert "node 1 exited with an error; its log ends:\n" in text
    assert "  RuntimeError: the site's process group broke\n" in text
    assert "line 12" not in text  # the last eight lines only
    # a failed node without a log is still named
    (nodes[1].data_dir / "node.log").unlink()
    assert summarize(nodes, load_config(None, []))["failed_nodes"] == {"1": []}


def test_the_live_table_has_a_row_per_node(tmp_path: Path) -> None:
    nodes = [_node(tmp_path, i, [], state="training", loss=2.5) for i in range(3)]
    table = render_table(nodes)
    assert table.row_count == 3 and table.columns[2].header == "state"
    assert list(table.columns[5].cells) == ["2.500"] * 3


def test_copies_that_differ_are_reported_with_how_far_apart_they_are(tmp_path: Path) -> None:
    """Groups that mix hold different copies by design: the summary says by how much,
    from the nodes' newest checkpoints (of the round most of them reached)."""
    import torch

    from node.train.checkpoint import save_checkpoint

    copies = {0: [1.0, 0.0], 1: [1.0, 0.2]}
    nodes = [_node(tmp_path, i, ["aa", f"b{i}"]) for i in range(3)]
    for i, values in copies.items():
        g = torch.tensor(values)
        save_checkpoint(
            nodes[i].data_dir / "checkpoints", 2, {"outer": {"globals": [g[:1], g[1:]]}}
        )
    save_checkpoint(nodes[2].data_dir / "checkpoints", 1, {"outer": {"globals": [torch.ones(2)]}})
    summary = summarize(nodes, load_config(None, []))
    assert not summary["params_agree"]
    apart = summary["copies_apart"]
    # mean (1, 0.1): each copy 0.1 from it, over a norm of sqrt(1.01)
    assert apart["round"] == 2 and apart["nodes"] == 2
    assert abs(apart["max_from_mean"] - 0.1 / 1.01**0.5) < 1e-6
    summary.update(seconds=3.0, directory=str(tmp_path))
    text = format_summary(summary)
    assert "params agree: False (copies of round 2 up to 10 % of their norm from their mean" in text
    # nothing to compare: no figure, and no failure
    (tmp_path / "other").mkdir()
    assert (
        summarize(
            [_node(tmp_path / "other", 0, ["aa"]), _node(tmp_path / "other", 1, ["bb"])],
            load_config(None, []),
        )["copies_apart"]
        is None
    )
