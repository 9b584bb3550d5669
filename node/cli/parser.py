"""Commands as data: an argument, a command and a group of subcommands, and the short
loop that turns a table of them into an ``argparse`` parser (the table of ``atoll`` is
:mod:`node.cli.commands`).

A command's function is named as ``module:function`` under :mod:`node.cli` and imported
only when the command runs, so ``atoll --help`` and every command's help load neither
torch nor hivemind.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["Arg", "Command", "Group", "arg", "build_parser"]


@dataclass(frozen=True)
class Arg:
    """One argument: what ``ArgumentParser.add_argument`` takes."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    """An :class:`Arg` written as a call to ``add_argument``."""
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    """A command: its name, one-line help, arguments and ``module:function`` run."""

    name: str
    help: str
    run: str
    args: tuple[Arg, ...] = ()
    description: str | None = None


@dataclass(frozen=True)
class Group:
    """A command of subcommands (``atoll audit verify``); ``dest`` holds the one chosen."""

    name: str
    help: str
    dest: str
    commands: tuple[Command, ...] = ()


def build_parser(
    prog: str, description: str, options: tuple[Arg, ...], commands: tuple[Command | Group, ...]
) -> argparse.ArgumentParser:
    """An ``argparse`` parser built from tables.

    Args:
        prog: the program's name in usage lines.
        description: the text ``--help`` starts with.
        options: the options before the command (``-v``, ``--version``...).
        commands: the commands; the chosen one's name goes to ``command`` (a group's
            subcommand to the group's ``dest``).

    Returns:
        The parser; each command sets ``func``, which runs it on the parsed arguments.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    _add_args(parser, options)
    _add_commands(parser, "command", commands)
    return parser


def _add_commands(
    parser: argparse.ArgumentParser, dest: str, commands: tuple[Command | Group, ...]
) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    for command in commands:
        options = {"help": command.help}
        if isinstance(command, Command) and command.description:
            options["description"] = command.description
        child = sub.add_parser(command.name, **options)
        if isinstance(command, Group):
            _add_commands(child, command.dest, command.commands)
        else:
            _add_args(child, command.args)
            child.set_defaults(func=_Run(command.run))


def _add_args(parser: argparse.ArgumentParser, args: tuple[Arg, ...]) -> None:
    for a in args:
        parser.add_argument(*a.flags, **a.options)


@dataclass(frozen=True)
class _Run:
    """A command's function, imported when the command runs."""

    target: str

    def __call__(self, args: argparse.Namespace) -> int:
        module, _, name = self.target.partition(":")
        function = getattr(importlib.import_module(f"node.cli.{module}"), name)
        return function(args)  # type: ignore[no-any-return]
