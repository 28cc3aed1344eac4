"""Start and stop agentq processes by PID: for ``agentq dev``, the scripts and the tests.

Every process is started in its own session (``start_new_session=True``), so it is the
leader of its own process group: ``stop()`` signals the whole group, which takes the
prefork children of a Celery worker down with their parent. Output (stdout and stderr)
goes to a log file; ``start_*`` waits until a ready line appears in it.

Nothing started here is allowed to outlive the process that started it: every live
``ManagedProcess`` (and every :class:`~agentq.local.redis_server.RedisServer`) is kept
in a module-level registry, and an ``atexit`` hook kills whatever is left, so a crashed
test does not leave workers behind.

    with start_worker("tools", env={"AGENTQ_REDIS_URL": url}, hostname="tools1@%h") as w:
        ...
        wait_for(lambda: w.children_pids(), timeout_s=10, message="no pool processes")
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import psutil

from agentq.fleet.lifecycle import Started

__all__ = [
    "CELERY_READY_PATTERN",
    "Child",
    "JSON_READY_PATTERN",
    "ManagedProcess",
    "ProcessStartError",
    "Spawner",
    "WaitTimeout",
    "kill_all",
    "run_process",
    "start_process",
    "start_worker",
    "use_spawner",
    "wait_for",
]

T = TypeVar("T")

CELERY_READY_PATTERN = r"\bready\.[ \t]*\r?$"
"""Celery's worker ready line: ``... celery@host ready.`` (matched per line)."""
JSON_READY_PATTERN = r'"message": "[^"]*\bready\."'
"""The same line from a worker with `AGENTQ_LOG_FORMAT=json`."""

_POLL_S = 0.02


class ProcessStartError(RuntimeError):
    """A process exited before it was ready, or was not ready by its deadline."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        text = message if not log_tail else f"{message}\n--- log tail ---\n{log_tail}"
        super().__init__(text)
        self.log_tail = log_tail


_ERROR_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit|Interrupt)\b.*)$", re.M)


def last_error(log_text: str) -> str:
    """The last line of a log that names an exception (`SyntaxError: expected '('`): why a
    process died, in one line; empty when none does."""
    found = _ERROR_LINE.findall(log_text)
    return found[-1].strip()[:300] if found else ""


class WaitTimeout(AssertionError, TimeoutError):
    """``wait_for`` ran out of time; both an ``AssertionError`` and a ``TimeoutError``."""


# --------------------------------------------------------------------------- registry


class _Killable(Protocol):
    def _kill_at_exit(self) -> None: ...


_registry: dict[int, _Killable] = {}
_registry_lock = threading.Lock()
_owner_pid = os.getpid()


def _register(obj: _Killable) -> None:
    with _registry_lock:
        _registry[id(obj)] = obj


def _unregister(obj: _Killable) -> None:
    with _registry_lock:
        _registry.pop(id(obj), None)


def kill_all() -> None:
    """Kill every process started by this module (and every embedded Redis) still alive."""
    if os.getpid() != _owner_pid:  # a forked child must not kill its parent's processes
        return
    with _registry_lock:
        left = list(_registry.values())
    for obj in left:
        with contextlib.suppress(Exception):
            obj._kill_at_exit()


atexit.register(kill_all)


class Child(Protocol):
    """What a started process tells, as ``subprocess.Popen`` does."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Spawner(Protocol):
    """Starts some commands another way than ``subprocess.Popen`` (the suite's fork server)."""

    def accepts(self, argv: Sequence[str]) -> bool: ...

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        stderr_path: Path | None = None,
        cwd: str | Path | None = None,
    ) -> Child: ...

    def stop(self) -> None: ...


_spawner: Spawner | None = None


def use_spawner(spawner: Spawner | None) -> None:
    """Start the commands ``spawner`` accepts with it (``None``: all with ``Popen``)."""
    global _spawner
    old, _spawner = _spawner, spawner
    if old is not None and old is not spawner:
        old.stop()


# --------------------------------------------------------------------------- helpers


def wait_for(
    predicate: Callable[[], T],
    timeout_s: float,
    interval_s: float = _POLL_S,
    message: str = "",
    *,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises :class:`WaitTimeout` (an ``AssertionError`` and a ``TimeoutError``) with
    ``message`` when ``timeout_s`` passes. Exceptions of the types in ``ignore`` count as
    "not yet" (the last one is named in the error); any other exception propagates.
    The predicate is always called at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        expired = time.monotonic() >= deadline
        try:
            value = predicate()
        except ignore as exc:
            last_exc = exc
        else:
            if value:
                return value
        if expired:
            break
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    what = message or f"condition {getattr(predicate, '__name__', predicate)!r}"
    detail = f" (last error: {last_exc!r})" if last_exc is not None else ""
    raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for: {what}{detail}")


def _tail(text: str, lines: int = 40, max_chars: int = 6000) -> str:
    out = "\n".join(text.splitlines()[-lines:])
    return out[-max_chars:]


def _build_env(env: Mapping[str, str] | None, inherit_env: bool) -> dict[str, str]:
    merged: dict[str, str] = dict(os.environ) if inherit_env else {}
    if env:
        merged.update(env)
    merged.setdefault("PYTHONUNBUFFERED", "1")
    return merged


# --------------------------------------------------------------------------- ManagedProcess


class ManagedProcess(Started):
    """A child process leading its own process group, with its output in a log file."""

    def __init__(
        self,
        popen: Child,
        *,
        argv: Sequence[str],
        log_path: Path,
        owns_log: bool = False,
        name: str | None = None,
    ) -> None:
        self._popen = popen
        self.argv: list[str] = list(argv)
        self.log_path = log_path
        self.name = name or Path(self.argv[0]).name
        self._owns_log = owns_log
        self._final_log: str | None = None
        self._lock = threading.Lock()
        self._stopped = False
        _register(self)

    # -- identity and state

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def pgid(self) -> int:
        """The process group: the process leads its own (``start_new_session``)."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def is_running(self) -> bool:
        return self._popen.poll() is None

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the process to exit; ``subprocess.TimeoutExpired`` on timeout."""
        return self._popen.wait(timeout=timeout_s)

    def children_pids(self) -> list[int]:
        """PIDs of all live descendants (recursive), e.g. a prefork pool's processes."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        return [c.pid for c in children if _alive(c)]

    def log_text(self) -> str:
        """Everything the process wrote so far (stdout and stderr, interleaved)."""
        if self._final_log is not None:
            return self._final_log
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_text(), lines)

    # -- stopping

    def stop(self, timeout_s: float = 10) -> int:
        """SIGTERM the process group; SIGKILL it after ``timeout_s``; reap. Idempotent.

        Returns the exit code of the main process (negative: killed by that signal).
        Descendants that outlive the main process (same group) get the rest of the time,
        then SIGKILL.
        """
        with self._lock:
            if self._stopped:
                return self._popen.returncode if self._popen.returncode is not None else -9
            tracked = self._tracked()
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            try:
                self._popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._popen.wait()
            self._finish_group(tracked, deadline)
            return self._finalize()

    def kill(self) -> int:
        """SIGKILL the whole process group at once and reap. Idempotent."""
        with self._lock:
            if self._stopped:
                return self._popen.returncode if self._popen.returncode is not None else -9
            tracked = self._tracked()
            self._signal_group(signal.SIGKILL)
            self._popen.wait()
            self._finish_group(tracked, time.monotonic())
            return self._finalize()

    def _kill_at_exit(self) -> None:
        self.kill()

    def _tracked(self) -> list[psutil.Process]:
        try:
            children: list[psutil.Process] = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        return children

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            # The group is gone (or only our unreaped zombie is left): signal the PID.
            if self._popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, sig)

    def _finish_group(self, tracked: list[psutil.Process], deadline: float) -> None:
        """After the main process is reaped: give stragglers until ``deadline``, then kill."""
        while any(_alive(p) for p in tracked) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        left = [p for p in tracked if _alive(p)]
        if left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(left, timeout=5)
        # Orphans we could not see (the main process had already exited when stop() was
        # called) still carry the group id: make sure nothing in the group survives.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)

    def _finalize(self) -> int:
        self._stopped = True
        _unregister(self)
        if self._owns_log:
            self._final_log = self.log_text()
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            with contextlib.suppress(OSError):
                self.log_path.parent.rmdir()
        rc = self._popen.returncode
        return rc if rc is not None else -9

    def start(self) -> ManagedProcess:
        """Already running: the process starts when it is made; `with` only stops it."""
        return self

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited {self.returncode}"
        return f"<ManagedProcess {self.name} pid={self.pid} {state}>"


def _alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- starting


def start_process(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    ready_pattern: str | None = None,
    ready_timeout_s: float = 30.0,
    *,
    cwd: str | Path | None = None,
    inherit_env: bool = True,
    name: str | None = None,
) -> ManagedProcess:
    """Start ``argv`` in its own process group, output to ``log_path``, and wait until ready.

    ``env`` is laid over ``os.environ`` (unless ``inherit_env=False``). Without
    ``log_path`` the log goes to a temporary file that is removed on stop (its text
    is kept for ``log_text()``). ``ready_pattern`` is a regular expression searched line
    by line (``re.MULTILINE``) in the log; ``None`` means do not wait. If the process
    exits first, or the pattern has not appeared within ``ready_timeout_s``, the
    process group is killed and :class:`ProcessStartError` is raised with the log tail.
    """
    argv = [str(a) for a in argv]
    label = name or Path(argv[0]).name
    owns_log = log_path is None
    if log_path is None:
        tmpdir = Path(tempfile.mkdtemp(prefix="agentq-proc-"))
        log_path = tmpdir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}.log"
    else:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)

    popen: Child
    try:
        if _spawner is not None and _spawner.accepts(argv):
            popen = _spawner.spawn(
                argv, env=_build_env(env, inherit_env), log_path=log_path, cwd=cwd
            )
        else:
            with open(log_path, "ab", buffering=0) as log:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=_build_env(env, inherit_env),
                    cwd=cwd,
                    start_new_session=True,
                    close_fds=True,
                )
    except OSError:
        if owns_log:
            shutil.rmtree(log_path.parent, ignore_errors=True)
        raise
    proc = ManagedProcess(popen, argv=argv, log_path=log_path, owns_log=owns_log, name=label)
    if ready_pattern is None:
        return proc

    ready = re.compile(ready_pattern, re.MULTILINE)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if ready.search(proc.log_text()):
            return proc
        rc = proc.poll()
        if rc is not None:
            proc.kill()
            raise ProcessStartError(
                f"{label} (pid {proc.pid}) exited with code {rc} before it was ready "
                f"(waited for /{ready_pattern}/ in {log_path})",
                proc.log_tail(),
            )
        if time.monotonic() >= deadline:
            tail = proc.log_tail()
            proc.kill()
            raise ProcessStartError(
                f"{label} (pid {proc.pid}) was not ready within {ready_timeout_s:g}s "
                f"(no /{ready_pattern}/ in {log_path}); killed it",
                tail,
            )
        time.sleep(_POLL_S)


def run_process(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end, its output captured, as ``subprocess.run`` does.

    ``env`` is the whole environment (``os.environ`` when ``None``); stdin is
    ``/dev/null``. A command the spawner accepts (:func:`use_spawner`) runs through it.
    """
    argv = [str(a) for a in argv]
    full_env = dict(os.environ if env is None else env)
    if _spawner is None or not _spawner.accepts(argv):
        return subprocess.run(
            argv,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    with tempfile.TemporaryDirectory(prefix="agentq-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = _spawner.spawn(argv, env=full_env, log_path=out, stderr_path=err)
        try:
            rc = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        read = {"encoding": "utf-8", "errors": "replace"}
        return subprocess.CompletedProcess(argv, rc, out.read_text(**read), err.read_text(**read))


def start_worker(
    kind: str,
    *,
    env: dict[str, str],
    hostname: str,
    concurrency: int | None = None,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    ready_timeout_s: float = 30,
    loglevel: str = "INFO",
    ready_pattern: str = CELERY_READY_PATTERN,
) -> ManagedProcess:
    """Start ``python -m agentq worker KIND --hostname H --loglevel INFO ...`` and wait
    for Celery's ``ready.`` line.

    ``kind`` is ``turns``, ``llm`` or ``tools``; ``env`` is laid over ``os.environ``
    (put ``AGENTQ_REDIS_URL`` etc. in it); ``hostname`` is Celery's node name, e.g.
    ``"tools1@%h"`` — make it unique per worker so Flower and revokes can tell them apart.
    """
    argv = [
        sys.executable,
        "-m",
        "agentq",
        "worker",
        kind,
        "--hostname",
        hostname,
        "--loglevel",
        loglevel,
    ]
    if concurrency is not None:
        argv += ["--concurrency", str(concurrency)]
    argv += list(extra_args)
    return start_process(
        argv,
        env=env,
        log_path=log_path,
        ready_pattern=ready_pattern,
        ready_timeout_s=ready_timeout_s,
        name=f"worker-{kind}-{hostname.split('@', 1)[0]}",
    )
