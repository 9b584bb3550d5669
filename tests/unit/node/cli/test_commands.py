"""The table of ``atoll``'s commands: each names a function that exists, in the order
``atoll --help`` lists them, and the parser built from it takes their arguments."""

from __future__ import annotations

import importlib

import pytest

from node.cli.commands import COMMANDS, atoll_parser
from node.cli.parser import Command, Group


def _commands(table=COMMANDS, prefix=()):
    for entry in table:
        if isinstance(entry, Group):
            yield from _commands(entry.commands, (*prefix, entry.name))
        else:
            yield (*prefix, entry.name), entry


def test_every_command_runs_a_function_that_exists() -> None:
    for path, command in _commands():
        module, _, name = command.run.partition(":")
        function = getattr(importlib.import_module(f"node.cli.{module}"), name, None)
        assert callable(function), f"atoll {' '.join(path)}: {command.run}"
        assert command.help, path


def test_the_help_lists_the_commands_in_table_order(capsys) -> None:
    with pytest.raises(SystemExit):
        atoll_parser().parse_args(["--help"])
    usage = capsys.readouterr().out
    names = [c.name for c in COMMANDS]
    assert len(set(names)) == len(names)
    positions = [usage.index(f"    {name} ") for name in names]
    assert positions == sorted(positions)


def test_the_parser_takes_each_commands_arguments() -> None:
    args = atoll_parser().parse_args(
        ["-v", "run", "--set", "sync.codec=int8", "--set", "run.seed=3", "--rounds", "2"]
    )
    assert args.command == "run" and args.verbose and args.rounds == 2
    assert args.overrides == ["sync.codec=int8", "run.seed=3"]
    audit = atoll_parser().parse_args(["audit", "show", "--json"])
    assert audit.command == "audit" and audit.json


def test_the_version_is_the_installed_packages(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        atoll_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("atoll ")
    assert all(isinstance(c, (Command, Group)) for c in COMMANDS)
