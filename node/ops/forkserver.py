"""Start node processes by forking one that has already imported what a node imports:
the launcher's side (the server's own process is :mod:`node.ops.forkserver_process`).

A node process spends about four CPU-seconds importing torch, hivemind and its own
modules before it does anything. A launcher that starts many nodes on one machine
(``atoll swarm``, the benchmarks, the tests) pays that once per node, and on a small
machine the nodes starting together fight over the cores for it. The fork server is a
process that imports those modules once and then forks a child per node: the child
takes the node's command line, environment, working directory and output, and runs
``python -m MODULE ARGS`` as that command would, sharing the imported modules' memory
with its siblings until it writes to it.

What a child differs in from a process started afresh, and why that is safe here:

- Its command line, as ``ps`` shows it, is set to the one it was started for
  (``setproctitle``), so a node forked and a node started afresh look alike there.
- It is the fork server's child, not the launcher's. :class:`ForkedProcess` gives the
  launcher what it uses of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``,
  ``returncode``, ``send_signal``, ``terminate``, ``kill``; the server reports each
  child's exit status as the child ends.
- Modules were imported under the server's environment. A request whose environment
  differs in a variable read at import (torch's, OpenMP's, hivemind's, the Hugging
  Face libraries', Python's own, the emulated link's:
  :data:`~node.ops.forkserver_process.IMPORT_TIME_ENV`) is refused, and the launcher
  starts that process the ordinary way.
- The server runs no thread of its own, no event loop and no torch operation before it
  forks (torch and hivemind each leave an idle native thread behind at import, which
  the child does not inherit, as with the data loaders' forked workers).

``ATOLL_FORKSERVER=0`` turns it off: every process is then started with
``subprocess.Popen``. Where the server cannot start, or dies, processes are started the
ordinary way as well, with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from node.ops.forkserver_process import MESSAGE_BYTES

__all__ = ["ENV_VAR", "ForkServer", "ForkedProcess", "popen"]

logger = logging.getLogger(__name__)

ENV_VAR = "ATOLL_FORKSERVER"
"""Set to ``0`` to start every node process with ``subprocess.Popen``."""

PRELOAD = ("node.daemon", "node.cli", "torch._dynamo", "torch.optim")
"""What the server imports before it forks (what every node imports as it starts)."""

_START_TIMEOUT = 60.0
_REPLY_TIMEOUT = 10.0


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "no", "off")


class ForkedProcess:
    """A process the fork server started: the part of ``subprocess.Popen`` launchers use.

    Its exit status comes from the server, which is its parent. Should the server die
    first, a process found gone is given ``returncode`` -1 (its status is lost with it).
    """

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server.wait_for_exit(self.pid, 0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the server, asks it for children, hears their ends.

    Thread-safe. One reader thread takes every message from the server: replies to
    requests, and exit reports, which it keeps by pid.
    """

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self._preload = tuple(preload)
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._replies: list[dict] = []
        self._exits: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._alive = False

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self) -> bool:
        """Start the server and wait until it has imported; whether it is up."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    "-m",
                    "node.ops.forkserver_process",
                    str(theirs.fileno()),
                    *self._preload,
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the launcher is the launcher's to handle
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            theirs.close()
        self._sock = mine
        mine.settimeout(_START_TIMEOUT)
        try:
            ready = msgpack.unpackb(mine.recv(MESSAGE_BYTES))
        except (OSError, ValueError) as e:
            ready = {"error": f"no answer: {e}"}
        if not isinstance(ready, dict) or "ready" not in ready:
            logger.warning("fork server did not start (%s); starting nodes the ordinary way", ready)
            self.close()
            return False
        mine.settimeout(None)
        self._alive = True
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        return True

    def spawn(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        out_fd: int,
        err_fd: int,
        new_session: bool,
    ) -> ForkedProcess | None:
        """A child running ``args`` (``python -m MODULE ...``), or None where the server
        refused it or is gone (the caller then starts it the ordinary way)."""
        request = {
            "title": " ".join(args),
            "argv": list(args[3:]),
            "module": args[2],
            "env": dict(env),
            "cwd": cwd,
            "session": new_session,
            "same_err": out_fd == err_fd,
        }
        fds = [out_fd] if out_fd == err_fd else [out_fd, err_fd]
        with self._lock:
            if not self._alive or self._sock is None:
                return None
            try:
                socket.send_fds(self._sock, [msgpack.packb(request)], fds)
            except OSError as e:
                logger.warning("fork server gone (%s); starting nodes the ordinary way", e)
                self._alive = False
                return None
            reply = self._next_reply()
        if reply is None:
            return None
        if "refused" in reply:
            logger.debug("fork server refused %s: %s", args[2], reply["refused"])
            return None
        return ForkedProcess(self, int(reply["pid"]), args)

    def _next_reply(self) -> dict | None:
        deadline = time.monotonic() + _REPLY_TIMEOUT
        with self._changed:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._alive:
                    if self._alive:
                        logger.warning(
                            "fork server did not answer; starting nodes the ordinary way"
                        )
                        self._alive = False
                    return None
                self._changed.wait(left)
            return self._replies.pop(0)

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            message = msgpack.unpackb(data)
            with self._changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            self._alive = False
            self._changed.notify_all()

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code once the server reported it (negative: the signal); it is
        handed over once (:class:`ForkedProcess` keeps it), so reports do not pile up."""
        with self._changed:
            if pid in self._exits:
                return self._exits.pop(pid)
            if self._alive:
                return None
        try:  # the server is gone, and the child's status with it
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            pass
        return None

    def wait_for_exit(self, pid: int, timeout: float) -> None:
        with self._changed:
            if pid not in self._exits and self._alive:
                self._changed.wait(timeout)
                return
        time.sleep(min(timeout, 0.1))

    def close(self) -> None:
        """Stop the server (its running children go on: each is stopped by its launcher)."""
        self._alive = False
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)


_default: ForkServer | None = None
_default_lock = threading.Lock()


def _server() -> ForkServer | None:
    global _default
    with _default_lock:
        if _default is None:
            _default = ForkServer()
            if _default.start():
                atexit.register(_default.close)
        return _default if _default.alive else None


def popen(
    args: Sequence[str],
    *,
    stdout: Any = None,
    stderr: Any = None,
    stdin: Any = None,
    start_new_session: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.Popen | ForkedProcess:
    """``subprocess.Popen`` for a ``python -m MODULE ...`` command, forked from the
    fork server where it can be (see the module docstring), else started as usual.

    ``stdout`` and ``stderr`` may be a file, ``subprocess.DEVNULL`` or None (this
    process's own), ``stderr`` also ``subprocess.STDOUT``; ``stdin`` only
    ``subprocess.DEVNULL`` or None (a forked child reads /dev/null)."""
    kwargs = {
        "stdout": stdout,
        "stderr": stderr,
        "stdin": stdin,
        "start_new_session": start_new_session,
        "env": env,
        "cwd": cwd,
    }
    forkable = (
        len(args) >= 3
        and args[0] == sys.executable
        and args[1] == "-m"
        and stdin in (None, subprocess.DEVNULL)
        and _stream_ok(stdout)
        and (stderr is subprocess.STDOUT or _stream_ok(stderr))
        and _wanted()
    )
    server = _server() if forkable else None
    if server is None:
        return subprocess.Popen(args, **kwargs)
    with contextlib.ExitStack() as opened:
        out_fd = _fd(stdout, 1, opened)
        err_fd = out_fd if stderr is subprocess.STDOUT else _fd(stderr, 2, opened)
        child = server.spawn(
            args,
            env=os.environ if env is None else env,
            cwd=os.fspath(cwd) if cwd is not None else os.getcwd(),
            out_fd=out_fd,
            err_fd=err_fd,
            new_session=start_new_session,
        )
    return child if child is not None else subprocess.Popen(args, **kwargs)


def _stream_ok(stream: Any) -> bool:
    return stream is None or stream is subprocess.DEVNULL or hasattr(stream, "fileno")


def _fd(stream: Any, default: int, opened: contextlib.ExitStack) -> int:
    if stream is None:
        return default
    if stream is subprocess.DEVNULL:
        return opened.enter_context(open(os.devnull, "wb")).fileno()
    return stream.fileno()
