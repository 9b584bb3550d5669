"""The fork server's own process (:mod:`node.ops.forkserver` starts it and talks to it):
it imports what a node imports, then answers each request by forking a child, which
takes the request's session, output, environment and directory and runs
``python -m MODULE ARGS``; it reports each child's exit status as the child ends. A
request whose environment differs in a variable read at import is refused
(:func:`refusal`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
from collections.abc import Mapping

import msgpack
import setproctitle

__all__ = ["IMPORT_TIME_ENV", "MESSAGE_BYTES", "refusal"]

IMPORT_TIME_ENV = (
    "ATOLL_LINK_SHAPE",
    "CUDA",
    "GOMP",
    "HF_",
    "HIVEMIND",
    "KMP_",
    "LD_",
    "MALLOC",
    "MKL_",
    "OMP_",
    "OPENBLAS",
    "PYTHON",
    "PYTORCH",
    "TOKENIZERS",
    "TORCH",
    "TRANSFORMERS",
)
"""Prefixes of environment variables read as modules are imported; a request whose
environment differs from the server's in one of them is refused."""
_SAME_AT_RUN_TIME = frozenset({"PYTHONUNBUFFERED"})
"""Variables among those prefixes that the server already honours (it runs unbuffered)."""

MESSAGE_BYTES = 1 << 20
"""The largest message between the launcher and the server."""


def refusal(env: Mapping[str, str], base: Mapping[str, str]) -> str | None:
    """Why a child with ``env`` cannot be forked from a server imported under ``base``."""
    for key in sorted(k for k in set(env) | set(base) if env.get(k) != base.get(k)):
        if key in _SAME_AT_RUN_TIME:
            continue
        if key.startswith(IMPORT_TIME_ENV):
            return f"{key} differs from the fork server's, and is read at import"
    return None


def _serve(sock: socket.socket, base: Mapping[str, str], added: Mapping[str, str]) -> dict:
    """Answer requests until one is this process's own (in a forked child): return it.
    Exits when the launcher hangs up.

    Args:
        base: the environment the modules were imported under.
        added: what the imports added to it, which a child gets as well (a process
            started afresh would have had its imports add them).
    """
    children: dict[int, int] = {}  # pidfd -> pid
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    sock.send(msgpack.packb({"ready": os.getpid()}))
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 2)
                except OSError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)
                request = msgpack.unpackb(data)
                why = refusal(request["env"], base)
                if why is not None:
                    for fd in fds:
                        os.close(fd)
                    sock.send(msgpack.packb({"refused": why}))
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for pidfd in children:
                        os.close(pidfd)
                    sock.close()
                    _become(request, fds, added)
                    return request
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ)
                sock.send(msgpack.packb({"pid": pid}))
            else:
                pidfd = key.fd
                pid = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    sock.send(msgpack.packb({"exit": pid, "code": code}))


def _become(request: dict, fds: list[int], added: Mapping[str, str]) -> None:
    """In the forked child: take the request's session, output, environment and
    directory, as ``subprocess.Popen`` would have given them."""
    if request["session"]:
        os.setsid()
    out_fd = fds[0]
    err_fd = fds[0] if request["same_err"] else fds[1]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {null, *fds}:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update({**added, **request["env"]})
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    setproctitle.setproctitle(request["title"])  # what ps shows: its own command line
    if "numpy" in sys.modules:  # its global generator is not reseeded at fork, as random's is
        sys.modules["numpy"].random.seed()


def _main() -> None:
    fd = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    # set up here, while the environment is whole: the title's room is the memory of the
    # command line and the environment that follows it
    setproctitle.setproctitle(
        " ".join([sys.executable, "-m", "node.ops.forkserver_process", *sys.argv[1:]])
    )
    base = dict(os.environ)
    try:
        import importlib

        for name in sys.argv[2:]:
            importlib.import_module(name)
    except BaseException as e:  # any failure means: start nodes the ordinary way
        with contextlib.suppress(OSError):
            sock.send(msgpack.packb({"error": f"{type(e).__name__}: {e}"}))
        raise
    added = {k: v for k, v in os.environ.items() if k not in base}
    request = _serve(sock, base, added)
    import runpy

    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
