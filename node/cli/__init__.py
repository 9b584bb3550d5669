"""The ``atoll`` command line: user-facing output lives here and nowhere else.

:mod:`node.cli.parser` holds the table of commands; the commands live by theme in
:mod:`~node.cli.running` (simulate, run, swarm), :mod:`~node.cli.operating` (status,
peers, ban, pardon, audit), :mod:`~node.cli.preparing` (data prepare, keygen, spec,
plan) and :mod:`~node.cli.model` (export, sample); :mod:`~node.cli.errors` turns a
failure into the one line an operator reads.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from node.cli.commands import atoll_parser
from node.cli.errors import known_error
from node.cli.logs import formatter

__all__ = ["main"]

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
