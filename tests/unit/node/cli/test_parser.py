"""``atoll --help`` and each command's help load neither torch nor hivemind (they take
seconds to import; the commands that need them import them when they run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import contextlib, io, json, sys
from node.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "hivemind", "numpy") if m in sys.modules)
print(json.dumps({"heavy": heavy, "help": out.getvalue()}))
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["run", "--help"], ["swarm", "--help"], ["status", "--help"]]
)
def test_help_imports_neither_torch_nor_hivemind(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["heavy"] == []
    assert "usage: atoll" in answer["help"]


def test_top_level_help_states_the_purpose() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "--help"], capture_output=True, text=True, timeout=60
    )
    text = json.loads(done.stdout)["help"]
    assert "train one model across scattered machines" in text
