"""Where the CLI's and a node's log lines go, and how they read: text or JSON lines."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["formatter", "log_file"]

_LOG_FILE_BYTES = 10 * 2**20
_LOG_FILES_KEPT = 3
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LEVELS = {10: "debug", 20: "info", 30: "warning", 40: "error", 50: "critical"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: ``t`` (unix time), ``level``,
    ``logger``, ``message`` and, for an exception, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "t": round(record.created, 3),
            # by number: libraries rename levels (hivemind's WARNING prints as WARN)
            "level": _LEVELS.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def formatter(kind: str) -> logging.Formatter:
    """The formatter of ``--log-format``: ``json`` or ``text``."""
    return _JsonFormatter() if kind == "json" else logging.Formatter(_LOG_FORMAT)


def log_file(args: argparse.Namespace, data_dir: Path) -> logging.Handler | None:
    """``DATA_DIR/node.log`` (or ``--log-file``), rotated at 10 MiB, 3 kept; None for
    ``--log-file -`` (``atoll swarm`` captures each node's stderr there itself)."""
    from logging.handlers import RotatingFileHandler

    if args.log_file == "-":
        return None
    path = Path(args.log_file) if args.log_file else data_dir / "node.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(
        path, maxBytes=_LOG_FILE_BYTES, backupCount=_LOG_FILES_KEPT, encoding="utf-8"
    )
    handler.setFormatter(formatter(args.log_format))
    logging.getLogger().addHandler(handler)
    return handler
