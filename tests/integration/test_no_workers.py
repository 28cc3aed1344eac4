"""A fleet with no live worker says so: `agentq run` names what to start within 10 s (a
turn and a stream worker, then the tool worker its call needs) and goes on waiting (the
turn runs once the workers start), and the gateway's /healthz and
POST /v1/turns name the missing kinds.

Each test has its own Redis, so the session's workers are not this fleet's.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from agentq.api import Client
from agentq.fleet import runtime
from agentq.gateway import create_app
from agentq.local.processes import start_worker
from agentq.local.redis_server import RedisServer
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import script

pytestmark = pytest.mark.integration

SAID_WITHIN_S = 10.0
STARTED_WITHIN_S = 60.0


@pytest.fixture()
def lone_env(agentq_env: dict[str, str]) -> Iterator[dict[str, str]]:
    with RedisServer() as redis_server:
        env = {
            **agentq_env,
            "AGENTQ_REDIS_URL": redis_server.url,
            "AGENTQ_BROKER_URL": redis_server.url,
        }
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        runtime.reset()
        try:
            yield env
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            runtime.reset()


def next_line_with(lines: queue.Queue[str], words: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no line with {words!r} within {timeout_s:g} s"
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if words in line:
            return line


def test_agentq_run_names_what_to_start_then_goes_on_when_it_starts(
    lone_env: dict[str, str], llm_server: object
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="echo", arguments={"text": "x"})]),
        Round(text="Hello from a late fleet."),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentq", "run", "--json", f"{key} hi"],
        env={**os.environ, **lone_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr
    threading.Thread(target=lambda: [lines.put(ln) for ln in stderr], daemon=True).start()
    workers = []
    try:
        # Generous for the process's own start on a loaded machine; the bound that matters
        # is checked below, from the turn's creation.
        said = next_line_with(lines, "no live worker", STARTED_WITHIN_S)
        heard_at = time.time()
        turn_id = said.split("turn ", 1)[1].split(" ", 1)[0]
        created_at = float(Client().get(turn_id)["state"]["created_at"])
        assert heard_at - created_at < SAID_WITHIN_S, (heard_at - created_at, said)
        assert "agentq.turns (start `agentq worker turns`)" in said, said
        assert "agentq.llm (start `agentq worker llm`)" in said, said
        assert proc.poll() is None  # it waits: the turn runs once the workers start
        tag = uuid.uuid4().hex[:6]
        for kind in ("turns", "llm"):
            workers.append(start_worker(kind, env=lone_env, hostname=f"late-{kind}-{tag}@%h"))
        # The model's round calls a tool: now the tool worker is what the turn waits for.
        said = next_line_with(lines, "agentq.tools", STARTED_WITHIN_S)
        assert "no live worker consumes agentq.tools (start `agentq worker tools`)" in said
        assert "agentq.turns" not in said
        workers.append(start_worker("tools", env=lone_env, hostname=f"late-tools-{tag}@%h"))
        assert proc.stdout is not None
        out = proc.stdout.read()
        assert proc.wait(60) == 0, out
        assert "Hello from a late fleet." in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for worker in workers:
            worker.stop()


def test_the_gateway_names_the_missing_kinds(lone_env: dict[str, str]) -> None:
    client = Client()
    with (
        BackgroundServer(create_app(client)) as gateway,
        httpx.Client(base_url=gateway.url, timeout=10) as http,
    ):
        health = http.get("/healthz")
        assert health.status_code == 200
        assert health.json()["missing_workers"] == ["turns", "llm"]
        assert health.json()["workers"]["agentq.turns"] == 0
        started = http.post("/v1/turns", json={"prompt": "anyone there?"})
        assert started.status_code == 202, started.text
        assert started.json()["missing_workers"] == ["turns", "llm"]


def test_client_wait_warns_and_its_timeout_names_what_to_start(
    lone_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    client = Client()
    handle = client._start_turn("anyone there?")
    with caplog.at_level("WARNING", logger="agentq.client"), pytest.raises(TimeoutError) as caught:
        client.wait(handle.turn_id, timeout_s=5)
    assert "start `agentq worker turns`" in str(caught.value)
    warned = [r.getMessage() for r in caplog.records if r.name == "agentq.client"]
    assert warned and "no live worker consumes agentq.turns" in warned[0], warned
