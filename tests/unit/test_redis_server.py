"""The embedded Redis and the process helpers (agentq.testing).

Real processes, no fixed sleeps: every wait is a poll with a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from agentq.errors import ConfigError
from agentq.local import processes
from agentq.local.processes import (
    ManagedProcess,
    ProcessStartError,
    WaitTimeout,
    start_process,
    start_worker,
    wait_for,
)
from agentq.local.redis_server import (
    RedisServer,
    RedisServerError,
    ensure_redis,
    find_free_port,
    find_redis_server,
    ping,
)

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    """The PID no longer names a live process (absent, or a zombie nobody reaped yet)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.stop()


# --------------------------------------------------------------------------- RedisServer


def test_find_redis_server_works() -> None:
    exe = find_redis_server()
    out = subprocess.run([exe, "--version"], capture_output=True, check=True, timeout=10)
    assert b"Redis server" in out.stdout


def test_start_ping_restart_stop(server: RedisServer) -> None:
    port, pid = server.port, server.pid
    assert server.url == f"redis://127.0.0.1:{port}/0"
    assert psutil.pid_exists(pid)

    client = redis.Redis.from_url(server.url)
    try:
        assert client.ping()
        assert client.set("k", "v")
        text_client = server.client(decode_responses=True)
        try:
            cfg = text_client.config_get("*")
        finally:
            text_client.close()
        assert cfg["save"] == "" and cfg["appendonly"] == "no"
        assert cfg["bind"] == "127.0.0.1"

        server.restart()
        assert server.port == port, "restart must keep the port"
        assert server.pid != pid
        assert _gone(pid), "the old server process must be gone after restart"
        # Same URL, same client: it reconnects; no persistence, so the data is gone.
        assert wait_for(client.ping, 5, message="PING after restart", ignore=(redis.RedisError,))
        assert client.get("k") is None
    finally:
        client.close()

    new_pid = server.pid
    server.stop()
    assert not psutil.pid_exists(new_pid), "stop() must kill and reap the server"
    assert not server.is_running()
    assert not ping(f"redis://127.0.0.1:{port}/0")
    server.stop()  # idempotent


def test_context_manager_and_explicit_port() -> None:
    port = find_free_port()
    with RedisServer(port=port) as srv:
        assert srv.port == port and ping(srv.url)
        pid, workdir = srv.pid, srv.dir
        assert workdir is not None and workdir.is_dir()
    assert _gone(pid)
    assert not workdir.exists(), "stop() removes the temporary directory"


def test_appendonly_keeps_data_across_restart() -> None:
    with RedisServer(appendonly=True) as srv:
        client = srv.client()
        try:
            client.set("k", "v")
            srv.restart()
            assert wait_for(client.ping, 5, ignore=(redis.RedisError,))
            assert client.get("k") == b"v"
        finally:
            client.close()


def test_kill_then_start_on_same_port(server: RedisServer) -> None:
    port, pid = server.port, server.pid
    server.kill()
    assert _gone(pid) and not server.is_running()
    server.start()
    assert server.port == port and ping(server.url)


def test_port_in_use_is_a_clear_error(server: RedisServer) -> None:
    other = RedisServer(port=server.port, startup_timeout_s=5)
    with pytest.raises(RedisServerError, match="already in use"):
        other.start()
    other.stop()
    assert ping(server.url)


def test_password() -> None:
    with RedisServer(password="s3cr/t") as srv:
        assert "s3cr%2Ft@" in srv.url
        assert ping(srv.url)
        assert not ping(f"redis://127.0.0.1:{srv.port}/0")


# --------------------------------------------------------------------------- ensure_redis


def test_ensure_redis_reachable_returns_no_handle(server: RedisServer) -> None:
    url, handle = ensure_redis(server.url)
    assert url == server.url and handle is None


def test_ensure_redis_starts_embedded_on_wanted_port() -> None:
    port = find_free_port()
    url, handle = ensure_redis(f"redis://localhost:{port}/3")
    try:
        assert handle is not None
        assert handle.port == port
        assert url == f"redis://127.0.0.1:{port}/3", "db number is kept"
        client = redis.Redis.from_url(url)
        try:
            assert client.ping()
            assert client.connection_pool.connection_kwargs["db"] == 3
        finally:
            client.close()
    finally:
        if handle is not None:
            handle.stop()


def test_ensure_redis_port_taken_by_something_else_uses_free_port() -> None:
    with socket.socket() as blocker:  # listens, never answers: not a Redis
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        taken = blocker.getsockname()[1]
        url, handle = ensure_redis(f"redis://127.0.0.1:{taken}/0")
        try:
            assert handle is not None and handle.port != taken
            assert ping(url) and url == handle.url
        finally:
            if handle is not None:
                handle.stop()


def test_ensure_redis_with_password() -> None:
    port = find_free_port()
    url, handle = ensure_redis(f"redis://:pw@127.0.0.1:{port}/0")
    try:
        assert handle is not None and url == f"redis://:pw@127.0.0.1:{port}/0"
        assert ping(url)
        # A Redis answers there now, but refuses a client without the password.
        with pytest.raises(ConfigError) as err:
            ensure_redis(f"redis://127.0.0.1:{port}/0")
        assert err.value.setting == "AGENTQ_REDIS_URL"
    finally:
        if handle is not None:
            handle.stop()


def test_ensure_redis_remote_unreachable_is_config_error() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never routed.
    with pytest.raises(ConfigError) as err:
        ensure_redis("redis://192.0.2.1:6379/0")
    assert err.value.setting == "AGENTQ_REDIS_URL"
    assert "no Redis answers at redis://192.0.2.1:6379/0" in str(err.value)


# --------------------------------------------------------------------------- wait_for


def test_wait_for_returns_the_truthy_value() -> None:
    calls = iter([0, None, "", "done"])
    assert wait_for(lambda: next(calls), timeout_s=5, interval_s=0.001) == "done"


def test_wait_for_times_out_with_message() -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="the moon"):
        wait_for(lambda: False, timeout_s=0.1, message="the moon")
    assert time.monotonic() - started >= 0.1
    assert issubclass(WaitTimeout, AssertionError) and issubclass(WaitTimeout, TimeoutError)


def test_wait_for_ignores_listed_exceptions_only() -> None:
    def boom() -> bool:
        raise ConnectionError("not yet")

    with pytest.raises(TimeoutError, match="not yet"):
        wait_for(boom, timeout_s=0.05, ignore=(ConnectionError,))
    with pytest.raises(ConnectionError):
        wait_for(boom, timeout_s=5)


# --------------------------------------------------------------------------- processes


READY_THEN_SLEEP = """
    import time
    print("booting")
    print("ready.", flush=True)
    time.sleep(120)
"""


def test_start_process_waits_for_ready_and_stop_kills(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    proc = start_process(_py(READY_THEN_SLEEP), env={}, log_path=log, ready_pattern=r"ready\.")
    try:
        assert proc.is_running() and psutil.pid_exists(proc.pid)
        assert "ready." in proc.log_text()
        assert os.getpgid(proc.pid) == proc.pid, "runs in its own process group"
        pid = proc.pid
    finally:
        rc = proc.stop()
    assert rc == -signal.SIGTERM
    assert not psutil.pid_exists(pid)
    assert proc.stop() == rc, "stop() is idempotent"
    assert log.exists() and "ready." in proc.log_text(), "a given log file is kept"


def test_start_process_env_is_laid_over_environ() -> None:
    code = """
        import os
        print("got", os.environ["AGENTQ_TEST_X"], "PATH" in os.environ, flush=True)
        print("ready.", flush=True)
        import time; time.sleep(120)
    """
    with start_process(_py(code), env={"AGENTQ_TEST_X": "42"}, ready_pattern=r"ready\.") as p:
        assert "got 42 True" in p.log_text()
        log_path = p.log_path
    assert not log_path.exists(), "a temporary log is removed on stop"
    assert "got 42 True" in p.log_text(), "and its text is kept"


def test_stop_kills_the_whole_group() -> None:
    code = """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("child", child.pid, flush=True)
        print("ready.", flush=True)
        time.sleep(120)
    """
    with start_process(_py(code), ready_pattern=r"ready\.", name="parent") as proc:
        kids = wait_for(proc.children_pids, 5, message="grandchild started")
        assert len(kids) == 1
        assert f"child {kids[0]}" in proc.log_text()
    assert all(_gone(k) for k in kids)
    assert _gone(proc.pid)


def test_stop_escalates_to_sigkill() -> None:
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready.", flush=True)
        time.sleep(120)
    """
    proc = start_process(_py(code), ready_pattern=r"ready\.")
    started = time.monotonic()
    assert proc.stop(timeout_s=0.3) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    assert not psutil.pid_exists(proc.pid)


def test_kill_is_immediate() -> None:
    proc = start_process(_py(READY_THEN_SLEEP), ready_pattern=r"ready\.")
    assert proc.kill() == -signal.SIGKILL
    assert not psutil.pid_exists(proc.pid)
    assert proc.stop() == -signal.SIGKILL


def test_exit_before_ready_fails_with_log_tail() -> None:
    code = """
        import sys
        print("config is broken: AGENTQ_SOMETHING", flush=True)
        sys.exit(3)
    """
    with pytest.raises(ProcessStartError, match="exited with code 3") as err:
        start_process(_py(code), ready_pattern=r"ready\.", ready_timeout_s=30)
    assert "AGENTQ_SOMETHING" in str(err.value)


def test_not_ready_by_deadline_is_killed() -> None:
    code = """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(120)
    """
    with pytest.raises(ProcessStartError, match="not ready within") as err:
        start_process(_py(code), ready_pattern=r"ready\.", ready_timeout_s=0.5)
    pid = int(err.value.log_tail.split()[1])
    assert not psutil.pid_exists(pid)


def test_atexit_kills_leftovers() -> None:
    """A test that crashes without stopping its processes does not leak them."""
    code = f"""
        from agentq.local.processes import start_process
        p = start_process({_py(READY_THEN_SLEEP)!r}, ready_pattern=r"ready\\.")
        print(p.pid, flush=True)
        raise SystemExit(1)   # no stop(): the atexit hook must clean up
    """
    out = subprocess.run(_py(code), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1, out.stderr
    pid = int(out.stdout.split()[0])
    assert wait_for(lambda: _gone(pid), 5, message=f"leftover pid {pid} killed at exit")


def test_registry_tracks_live_processes() -> None:
    proc = start_process(_py(READY_THEN_SLEEP), ready_pattern=r"ready\.")
    assert id(proc) in processes._registry
    proc.stop()
    assert id(proc) not in processes._registry


def test_start_worker_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_start_process(argv: list[str], **kwargs: object) -> ManagedProcess:
        seen.update(kwargs, argv=argv)
        raise RuntimeError("stop here")

    monkeypatch.setattr(processes, "start_process", fake_start_process)
    with pytest.raises(RuntimeError, match="stop here"):
        start_worker(
            "tools",
            env={"AGENTQ_REDIS_URL": "redis://127.0.0.1:1/0"},
            hostname="tools1@%h",
            concurrency=4,
            extra_args=["-Q", "agentq.tools,gpu"],
        )
    assert seen["argv"] == [
        sys.executable, "-m", "agentq", "worker", "tools",
        "--hostname", "tools1@%h", "--loglevel", "INFO",
        "--concurrency", "4", "-Q", "agentq.tools,gpu",
    ]  # fmt: skip
    assert seen["env"] == {"AGENTQ_REDIS_URL": "redis://127.0.0.1:1/0"}
    assert seen["ready_pattern"] == processes.CELERY_READY_PATTERN


def test_celery_ready_pattern_matches_celery_ready_line() -> None:
    import re

    pattern = re.compile(processes.CELERY_READY_PATTERN, re.MULTILINE)
    assert pattern.search("[2025-01-01 00:00:00,000: INFO/MainProcess] tools1@box ready.\n")
    assert not pattern.search("[...: INFO/MainProcess] mingle: searching for neighbors\n")
