"""The one line an operator reads when a command fails: what failed, and what to do.

A known failure (bad input, a file that cannot be written, a network side that does
not start) becomes one line and exit code 2; anything else is an internal error, exit 1,
with the traceback at debug level (``atoll -v``).
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

__all__ = ["file_problem", "known_error"]


def known_error(exc: Exception) -> str | None:
    """The one line for an error a user can act on, or None for an unexpected one."""
    from node.ops.swarm import NodeFailed
    from verification.errors import VerificationError

    if isinstance(exc, (ValueError, NodeFailed)):  # ConfigError, DataError, SpecError, ...
        return str(exc)
    if "node.train.site" in sys.modules:  # loaded by commands that may run as a site
        from node.train.site import SiteFailed

        if isinstance(exc, SiteFailed):
            return f"{exc}; the node stopped (torchrun stops the other ranks)"
    if isinstance(exc, VerificationError):
        return f"{exc}; check the file or peer it names"
    if isinstance(exc, OSError):
        return file_problem(exc)
    if isinstance(exc, RuntimeError) and "protocol.p2p.transport" in sys.modules:
        return _network_problem(exc)  # only commands that start a network side load it
    return None


def file_problem(exc: OSError, data_dir: Path | None = None) -> str:
    """One line for a file operation that failed: what failed, and what to do."""
    path = Path(exc.filename) if exc.filename else data_dir
    why = (exc.strerror or str(exc)).lower()
    inside = data_dir is not None and path is not None and path.is_relative_to(data_dir)
    place = f"the data directory {data_dir}" if inside else str(path or "a file")
    choose = "choose another --data-dir" if data_dir is not None else "choose another path"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        writing = f" (writing {path})" if path not in (None, data_dir) else ""
        return f"no space left on the disk of {place}{writing}; free some space or {choose}"
    if exc.errno == errno.EROFS:
        return f"cannot write to {place} ({why}); {choose.replace('another', 'a writable')}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to use {path or place} ({why}); fix its permissions or {choose}"
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and data_dir is not None:
        # a file where the data directory, or a directory above it, should be
        for p in (data_dir, *data_dir.parents):
            if p.exists() and not p.is_dir():
                where = "is a file" if p == data_dir else f"cannot be made: {p} is a file"
                return f"the data directory {data_dir} {where}, not a directory; {choose}"
    if exc.errno == errno.EISDIR:
        return f"{path} is a directory where a file belongs; move it away or {choose}"
    return f"{path or 'a file'}: {why}; check the path and its permissions"


def _network_problem(exc: RuntimeError) -> str | None:
    """The network side's start-up errors (:meth:`protocol.p2p.transport.Transport.start`)."""
    import concurrent.futures

    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from protocol.control.channel import ControlChannelError
    from protocol.p2p.transport import BootstrapUnreachable, NotDialable

    if isinstance(exc, (BootstrapUnreachable, NotDialable)):
        return str(exc)
    if isinstance(exc, ControlChannelError):
        return f"{exc}; check control.port and network.host, and run with -v for its output"
    if isinstance(exc.__cause__, (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError)):
        return (
            f"the network side did not start ({exc.__cause__}); check network.host and "
            "network.port, and run with -v for p2pd's output"
        )
    return None
