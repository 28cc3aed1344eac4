"""A Python with agentq's imports done that forks ``python -m agentq ...`` commands.

The test suite's spawner (:func:`agentq.local.processes.use_spawner`), not installed.

Starting a worker costs 1.6-3.3 CPU-s on a 2-core VM, nearly all of it importing Celery,
the OpenAI SDK and agentq, and the test suite starts a few hundred. The fork server
imports those once; each command is then a fork of it that leads its own session, writes
to its log file, takes the command's environment, working directory and ``PYTHONPATH``,
and runs its module as ``python -m`` does. Nothing that reads the environment at import
is imported before the fork: ``agentq.worker`` (the settings, the tool modules) is
imported by each child, so every child is configured by its own environment.

The protocol is one connection per command: a JSON line asks, the server answers
``pid N`` once forked and ``exit RC`` (as ``Popen.returncode``) once the child is reaped.
The server exits when the process that started it closes its stdin.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

__all__ = ["FORKABLE_MODULES", "ForkServer", "ForkedChild", "forkable"]

FORKABLE_MODULES = ("agentq", "workers.turns", "workers.llm", "workers.tools", "workers.io")
"""What a fork server runs: the agentq CLI and the worker entry points."""

PRELOAD = (
    "celery.bin.celery",
    "celery.apps.worker",
    "celery.worker.consumer",
    "celery.concurrency.prefork",
    "celery.concurrency.thread",
    "kombu.transport.redis",
    "openai",
    "agentq.cli.main",
    "agentq.cli.supervise",
    "agentq.fleet.app",
    "agentq.llm.aclient",
    "agentq.llm.task",
    "agentq.mcp.catalog",
    "agentq.orchestrator.scheduled",
    "agentq.orchestrator.steps",
    "agentq.tools.task",
    "agentq.webhooks.task",
    "agentq.gateway.app",
)
"""Imported before any fork; none reads the environment at import (agentq.worker does)."""


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``python -m <an agentq entry point> ...`` in this interpreter."""
    return (
        len(argv) >= 3
        and argv[0] == sys.executable
        and argv[1] == "-m"
        and (argv[2] in FORKABLE_MODULES)
    )


class ForkedChild:
    """What ``subprocess.Popen`` tells of a process, for a child of the fork server."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._read(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return rc

    def _read(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            deadline = None if timeout is None else time.monotonic() + timeout
            while b"\n" not in self._buf:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._conn.settimeout(left)
                try:
                    chunk = self._conn.recv(64)
                except (TimeoutError, BlockingIOError):
                    return None
                if not chunk:
                    # The server is gone: the child is no longer anyone's to reap.
                    return self._lost(deadline)
                self._buf += chunk
            line = self._buf.split(b"\n", 1)[0].decode()
            self.returncode = int(line.removeprefix("exit "))
            self._conn.close()
            return self.returncode

    def _lost(self, deadline: float | None) -> int | None:
        while _pid_alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        self.returncode = -signal.SIGKILL
        self._conn.close()
        return self.returncode


def _pid_alive(pid: int) -> bool:
    """Running, not a zombie: an orphan's zombie waits for whoever adopted it."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class ForkServer:
    """The client: starts the server on first use and asks it for one child per command."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="agentq-fork-"))
        self._path = str(self._dir / "s")
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _started(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path)
                listener.bind(self._path)
                listener.listen(64)
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.rigs.forkserver", str(listener.fileno())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    env={**env, "PYTHONUNBUFFERED": "1"},
                    cwd=str(Path(__file__).resolve().parents[2]),
                    pass_fds=(listener.fileno(),),
                    start_new_session=True,
                )
                listener.close()
            return self._path

    def accepts(self, argv: Sequence[str]) -> bool:
        return forkable(argv)

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        stderr_path: Path | None = None,
        cwd: str | Path | None = None,
    ) -> ForkedChild:
        """Fork ``argv`` (``python -m MODULE ARGS``, see :func:`forkable`); the child runs.

        Its stdout goes to ``log_path``, its stderr there too or to ``stderr_path``; both
        files exist when this returns. Its stdin is ``/dev/null``.
        """
        paths = [Path(p).resolve() for p in (log_path, stderr_path or log_path)]
        for path in paths:
            path.touch()
        request = {
            "module": argv[2],
            "args": list(argv[3:]),
            "env": dict(env),
            "cwd": str(Path(cwd or os.getcwd()).resolve()),
            "stdout": str(paths[0]),
            "stderr": str(paths[1]),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._started())
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = b""
        conn.settimeout(60)
        while not answer.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                conn.close()
                raise OSError(f"the fork server ended before it started {argv[2]}")
            answer += chunk
        return ForkedChild(conn, int(answer.decode().removeprefix("pid ")), argv)

    def stop(self) -> None:
        """Close the server's stdin (it exits) and wait for it; its children live on."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        with contextlib.suppress(OSError):
            self._dir.rmdir()


# --------------------------------------------------------------------------- the server


def _serve(listener: socket.socket) -> dict[str, object] | None:
    """Fork a child per request until stdin closes; in a child, return its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline" and not os.read(sys.stdin.fileno(), 4096):
                return None
            if key.data == "reap":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(waiting)
            if key.data == "accept":
                conn, _ = listener.accept()
                request = _read_request(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    for other in [listener, conn, *waiting.values()]:
                        other.close()
                    return request
                conn.sendall(f"pid {pid}\n".encode())
                waiting[pid] = conn
        # A child that exited before it was registered is reaped on the next wake-up.


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _read_request(conn: socket.socket) -> dict[str, object]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    request: dict[str, object] = json.loads(data)
    return request


def _become(request: dict[str, object]) -> None:
    """In the child: the session, output, environment and paths of ``python -m MODULE``."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        out = os.open(str(request[key]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    cwd = str(request["cwd"])
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *sys.path[1:]]
    args = request["args"]
    assert isinstance(args, list)
    sys.argv = [str(request["module"]), *map(str, args)]


def main(argv: Sequence[str]) -> None:
    import importlib
    import runpy

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(fileno=int(argv[0]))
    request = _serve(listener)
    if request is None:
        return
    _become(request)
    runpy.run_module(str(request["module"]), run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
