"""What comes before a run, as the command line runs it: a node key made once and kept,
a run spec shown as signed, a plan of a run's links."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from node.cli import main
from verification.identity import Identity


def test_keygen_makes_a_private_key_once_and_keeps_it(tmp_path: Path, capsys) -> None:
    data_dir = tmp_path / "a" / "node"
    assert main(["keygen", "--data-dir", str(data_dir)]) == 0
    key = data_dir / "identity.key"
    peer = Identity.load(key).peer_id
    assert capsys.readouterr().out.strip() == f"wrote {key}; PeerID {peer}"
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700  # the folders that hold keys
    assert main(["keygen", "--data-dir", str(data_dir)]) == 0
    assert "already exists (use --force to replace)" in capsys.readouterr().out
    assert Identity.load(key).peer_id == peer  # kept
    assert main(["keygen", "--data-dir", str(data_dir), "--force"]) == 0
    assert Identity.load(key).peer_id != peer


def test_keygen_over_a_broken_key_says_how_to_replace_it(tmp_path: Path, capsys) -> None:
    key = tmp_path / "identity.key"
    key.write_bytes(b"garbage")
    assert main(["keygen", "--out", str(key)]) == 2
    assert "pass --force to replace it" in capsys.readouterr().err


def test_a_spec_is_created_then_shown_as_signed(tmp_path: Path, capsys) -> None:
    spec = tmp_path / "spec.json"
    made = main(
        ["spec", "create", "--out", str(spec), "--data-dir", str(tmp_path / "node"),
         "--set", "run.run_id='prep-test'"]
    )  # fmt: skip
    assert made == 0
    said = capsys.readouterr().out
    assert "wrote" in said and "volunteers join with: atoll run --spec" in said
    assert main(["spec", "show", str(spec), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["run_id"] == "prep-test" and shown["t0"] > 0  # a wall-clock round trigger
    assert set(shown["shared"]) >= {"model", "sync", "outer"}


def test_plan_takes_the_command_lines_settings_over_the_configs(capsys) -> None:
    args = ["plan", "--config", "configs/islands.toml", "--step-seconds", "0.2"]
    assert main([*args, "--bandwidth-gbit", "1", "--codec", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["input"]["codec"] == "int8"  # the command line's, not the config's int4
    assert out["input"]["fragments"] == 5 and out["input"]["tau"] == 5  # the config's
    assert main([*args, "--bandwidth-gbit", "1", "--codec", "zip"]) == 2
    assert "sync.codec" in capsys.readouterr().err
