"""The ``atoll`` command line: user-facing output lives here and nowhere else.

:mod:`node.cli.parser` holds the table of commands; the commands live by theme in
:mod:`~node.cli.running` (simulate, run, swarm), :mod:`~node.cli.operating` (status,
peers, ban, pardon), :mod:`~node.cli.auditing` (audit), :mod:`~node.cli.preparing`
(data prepare, keygen, spec, plan) and :mod:`~node.cli.model` (export, sample);
:mod:`~node.cli.errors` turns a failure into the one line an operator reads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from node.cli.commands import atoll_parser
from node.cli.errors import known_error
from node.cli.logs import formatter

__all__ = ["console", "main"]

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``atoll`` console script."""
    args = atoll_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(formatter(args.log_format))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[stderr])
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into head or less, closed early
        return 0
    except KeyboardInterrupt:
        print("atoll: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # The traceback is for -v (debug logging); the operator gets one line.
        logger.debug("atoll %s failed", args.command, exc_info=True)
        line = known_error(exc)
        if line is None:
            print(f"atoll: internal error: {exc!r}; run with -v for the traceback", file=sys.stderr)
            return 1
        print(f"atoll: {line}", file=sys.stderr)
        return 2


def console() -> NoReturn:
    """The ``atoll`` command as a process (the console script and ``python -m
    node.cli``): :func:`main`, then the interpreter's exit handlers, then the end of the
    process, without tearing its modules down one by one (with torch and hivemind loaded
    that takes a node about a second of CPU and frees nothing the exit does not)."""
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
