"""Arguments several of ``atoll``'s commands share: the config files and overrides, a
node's data directory, a checkpoint's round.
"""

from __future__ import annotations

from node.cli.parser import arg

__all__ = ["CONFIG", "DATA_DIR", "ROUND"]

CONFIG = (
    arg(
        "--config",
        action="append",
        help="TOML config file; repeat to layer files, e.g. a trust policy (defaults when omitted)",
    ),
    arg(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set sync.codec=int8 (repeatable)",
    ),
)
DATA_DIR = arg("--data-dir", default=".atoll/node", help="the node's data directory")
ROUND = arg("--round", type=int, help="the checkpoint of this round (default newest)")
