"""A node's logs: DATA_DIR/node.log (rotated) besides stderr, text or JSON lines."""

from __future__ import annotations

import argparse
import json
import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path

from node.cli import logs
from node.cli.commands import atoll_parser


def _record(msg: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            import sys

            info = sys.exc_info()
    return logging.LogRecord("node.daemon", logging.WARNING, __file__, 1, msg, ("x",), info)


def test_json_lines_carry_time_level_logger_message_and_exception() -> None:
    line = logs.formatter("json").format(_record("peer %s refused"))
    entry = json.loads(line)
    assert entry["level"] == "warning" and entry["logger"] == "node.daemon"
    assert entry["message"] == "peer x refused" and isinstance(entry["t"], float)
    with_exc = json.loads(logs.formatter("json").format(_record("failed %s", exc=True)))
    assert "RuntimeError: boom" in with_exc["exc"]
    assert (
        logs.formatter("text")
        .format(_record("peer %s refused"))
        .endswith(" node.daemon: peer x refused")
    )


def test_a_node_logs_to_data_dir_node_log_rotated_unless_told_not_to(tmp_path: Path) -> None:
    args = argparse.Namespace(log_file=None, log_format="json")
    handler = logs.log_file(args, tmp_path / "node")
    assert isinstance(handler, RotatingFileHandler)
    try:
        assert handler.maxBytes == 10 * 2**20 and handler.backupCount == 3
        logging.getLogger("node.test").warning("hello %s", "log")
        handler.flush()
        line = (tmp_path / "node" / "node.log").read_text().strip().splitlines()[-1]
        assert json.loads(line)["message"] == "hello log"
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert logs.log_file(argparse.Namespace(log_file="-", log_format="text"), tmp_path) is None


def test_run_accepts_the_log_options() -> None:
    args = atoll_parser().parse_args(["--log-format", "json", "run", "--log-file", "/tmp/x.log"])
    assert (args.log_format, args.log_file) == ("json", "/tmp/x.log")
