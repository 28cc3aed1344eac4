"""Shared fixtures: a real Redis, real worker processes, a real scripted model server."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentq.fleet import runtime
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess, kill_all, use_spawner
from agentq.local.redis_server import RedisServer
from tests.rigs.forkserver import ForkServer
from tests.rigs.workers import worker_env

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"


BASE_TOOLS = "agentq.testing.tools,agentq.testing.agents,tests.agents_under_test"
"""The tools of a fleet whose budgets are sized by a round's prompt (every tool offered
counts in it)."""
TEST_TOOLS = f"{BASE_TOOLS},tests.waitpoint_tools"


def base_env(redis_url: str, llm_url: str | None = None, **extra: str) -> dict[str, str]:
    extra.setdefault("tools", TEST_TOOLS)
    env = worker_env(redis_url, llm_url, pythonpath=str(ROOT), **extra)
    # The fleet's metrics reach Redis every flush: tests that read /metrics wait less.
    env.setdefault("AGENTQ_METRICS_FLUSH_S", "0.5")
    return env


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def llm_server() -> Iterator[object]:
    from agentq.testing.openai_server import ScriptedOpenAIServer

    with ScriptedOpenAIServer() as server:
        yield server


@pytest.fixture(scope="session")
def agentq_env(redis_server: RedisServer, llm_server: object) -> Iterator[dict[str, str]]:
    env = base_env(redis_server.url, llm_server.url)  # type: ignore[attr-defined]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime.reset()
    import agentq.testing.tools  # noqa: F401 - the dispatcher validates against the registry
    import tests.waitpoint_tools  # noqa: F401

    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    runtime.reset()


@pytest.fixture(scope="session")
def local_fleet(agentq_env: dict[str, str]) -> Iterator[LocalFleet]:
    """The session's launcher: every worker a fixture or test starts, stopped at the end."""
    fleet = LocalFleet(agentq_env, log_dir=ARTIFACTS)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="session")
def tool_worker(local_fleet: LocalFleet) -> ManagedProcess:
    return local_fleet.start_worker("tools", concurrency=4)


@pytest.fixture(scope="session")
def io_worker(local_fleet: LocalFleet) -> ManagedProcess:
    # Only agentq.io: the recycle test runs its own worker on the queue of the tool
    # that blocks the loop for good.
    return local_fleet.start_worker("io", extra_args=("-Q", "agentq.io"))


@pytest.fixture(scope="session")
def llm_worker(local_fleet: LocalFleet) -> ManagedProcess:
    return local_fleet.start_worker("llm", concurrency=8)


@pytest.fixture(scope="session")
def turn_worker(local_fleet: LocalFleet) -> ManagedProcess:
    return local_fleet.start_worker("turns", concurrency=32)


@pytest.fixture(scope="session")
def fleet(
    tool_worker: ManagedProcess, llm_worker: ManagedProcess, turn_worker: ManagedProcess
) -> dict[str, ManagedProcess]:
    return {"tools": tool_worker, "llm": llm_worker, "turns": turn_worker}


@pytest.fixture()
def client(agentq_env: dict[str, str]) -> object:
    from agentq.api import Client

    return Client()


def pytest_sessionstart(session: pytest.Session) -> None:
    # A SIGTERMed test run (CI timeout, `kill`) still stops the processes it started:
    # exiting through SystemExit runs the atexit hook of agentq.local.processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Workers, gateways and CLI commands started by PID are forks of one pre-imported
    # Python: a start costs 0.2 CPU-s instead of 1.6-3.3, and the suite starts hundreds.
    use_spawner(ForkServer())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_all()
    use_spawner(None)
