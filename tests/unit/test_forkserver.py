"""The fork server: each command a fork with its own session, log, environment and exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from agentq.local import processes
from agentq.local.processes import run_process, wait_for
from agentq.local.redis_server import RedisServer, find_free_port
from tests.rigs.forkserver import ForkServer, forkable
from tests.rigs.workers import worker_env

# Real worker processes against the session's Redis, as in test_redis_server.
pytestmark = pytest.mark.integration


@pytest.fixture()
def server() -> Iterator[ForkServer]:
    fs = ForkServer()
    yield fs
    fs.stop()


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}, **extra}


def test_only_agentq_entry_points_of_this_interpreter_are_forked() -> None:
    assert forkable([sys.executable, "-m", "agentq", "worker", "turns"])
    assert forkable([sys.executable, "-m", "workers.llm"])
    assert not forkable([sys.executable, "-X", "importtime", "-m", "agentq"])
    assert not forkable([sys.executable, "-m", "celery", "-A", "agentq", "worker"])
    assert not forkable(["/usr/bin/python3-other", "-m", "agentq"])
    assert not forkable([sys.executable, "-c", "pass"])


def test_a_command_runs_with_its_own_arguments_log_and_exit_code(
    server: ForkServer, tmp_path: Path
) -> None:
    ok = server.spawn(
        [sys.executable, "-m", "agentq", "--version"], env=_env(), log_path=tmp_path / "ok.log"
    )
    bad = server.spawn(
        [sys.executable, "-m", "agentq", "no-such-command"],
        env=_env(),
        log_path=tmp_path / "bad.log",
    )
    assert ok.wait(timeout=30) == 0
    assert bad.wait(timeout=30) == 2
    assert "agentq" in (tmp_path / "ok.log").read_text()
    assert "invalid choice: 'no-such-command'" in (tmp_path / "bad.log").read_text()


def test_each_child_reads_its_own_environment(server: ForkServer, tmp_path: Path) -> None:
    # The settings are read in the child, not in the server: two children, two URLs.
    ports = [find_free_port(), find_free_port()]
    children = [
        server.spawn(
            [sys.executable, "-m", "agentq", "turns"],
            env=_env(AGENTQ_REDIS_URL=f"redis://127.0.0.1:{port}/0"),
            log_path=tmp_path / f"{port}.log",
        )
        for port in ports
    ]
    for child, port in zip(children, ports, strict=True):
        assert child.wait(timeout=60) != 0
        log = (tmp_path / f"{port}.log").read_text()
        assert f"127.0.0.1:{port}" in log, log
        other = ports[1 - ports.index(port)]
        assert f"127.0.0.1:{other}" not in log


def test_a_worker_leads_its_session_and_its_kill_is_reported(
    server: ForkServer, tmp_path: Path, redis_server: RedisServer
) -> None:
    log = tmp_path / "worker.log"
    child = server.spawn(
        [sys.executable, "-m", "agentq", "worker", "tools", "-c", "2", "-n", "fs@%h"],
        env=_env(**worker_env(redis_server.url)),
        log_path=log,
        cwd=tmp_path,
    )
    wait_for(lambda: "ready." in log.read_text(), timeout_s=60, message="the worker's ready line")
    assert os.getpgid(child.pid) == child.pid
    proc = psutil.Process(child.pid)
    assert proc.cwd() == str(tmp_path)
    assert len(proc.children()) == 2  # its prefork pool
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_children_outlive_a_stopped_server_and_their_end_is_still_seen(
    server: ForkServer, tmp_path: Path, redis_server: RedisServer
) -> None:
    log = tmp_path / "worker.log"
    child = server.spawn(
        [sys.executable, "-m", "agentq", "worker", "turns", "-n", "fs-orphan@%h"],
        env=_env(**worker_env(redis_server.url)),
        log_path=log,
    )
    wait_for(lambda: "ready." in log.read_text(), timeout_s=60, message="the worker's ready line")
    server.stop()
    assert child.poll() is None
    assert psutil.Process(child.pid).is_running()
    os.killpg(child.pid, signal.SIGKILL)
    # Nobody reports its exit code now: its end is seen from its PID.
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_run_process_captures_stdout_and_stderr_apart_and_kills_at_its_timeout(
    redis_server: RedisServer,
) -> None:
    assert isinstance(processes._spawner, ForkServer)  # the suite's conftest turns it on
    ok = run_process([sys.executable, "-m", "agentq", "--version"], env=_env())
    assert ok.returncode == 0 and "agentq" in ok.stdout and ok.stderr == ""
    bad = run_process([sys.executable, "-m", "agentq", "no-such-command"], env=_env())
    assert bad.returncode == 2 and bad.stdout == ""
    assert "invalid choice: 'no-such-command'" in bad.stderr
    before = _descendants()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process(
            [sys.executable, "-m", "agentq", "worker", "turns", "-n", "fs-timeout@%h"],
            env=_env(**worker_env(redis_server.url)),
            timeout_s=3,
        )
    assert _descendants() <= before  # the worker it started is gone, and reaped


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}
