"""``atoll export`` and ``atoll sample`` as the command line runs them: what they print,
and a directory without checkpoints as one line."""

from __future__ import annotations

from pathlib import Path

from node.cli import main
from tests.unit.node.ops.test_export import _checkpoint


def test_export_says_what_it_wrote_and_from_which_round(tmp_path: Path, capsys) -> None:
    _checkpoint(tmp_path / "node", 5, 0.25)
    out = tmp_path / "model.safetensors"
    assert main(["export", "--data-dir", str(tmp_path / "node"), "--out", str(out)]) == 0
    said = capsys.readouterr().out.strip()
    assert out.exists() and said.startswith(f"wrote {out}: ")
    assert "the global parameters of round 5 (run run-x" in said
    assert "global state digest abababababababab" in said


def test_without_a_checkpoint_export_and_sample_fail_in_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "--data-dir", str(empty), "--out", str(tmp_path / "m")]) == 2
    assert main(["sample", "--data-dir", str(empty), "--prompt", "hello"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 2 and "Traceback" not in captured.err and captured.out == ""
