"""MCP servers' tools as governed calls: real MCP servers (made here with the `mcp` SDK, and
the published `mcp-server-time`), a fresh Redis, real turn, stream and I/O workers, and the
scripted model.

The stack is the module's own (its own Redis), so the session's workers, which know no MCP
server, cannot take its tasks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from agentq import constants as k
from agentq.api import Client
from agentq.errors import AnswerInvalid
from agentq.events import Event
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess, start_process, wait_for
from agentq.local.redis_server import RedisServer
from agentq.mcp.listing import server_health
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import collect, process_env, script, wait_event

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0ken-" + uuid.uuid4().hex[:8]


@dataclass
class Stack:
    client: Client
    procs: dict[str, ManagedProcess]
    pid_file: Path
    log_file: Path
    redis_url: str


def _servers(pid_file: Path, log_file: Path, http_url: str) -> dict[str, Any]:
    test_server = [sys.executable, "-m", "agentq.testing.mcp_server"]
    return {
        "t": {
            "command": [*test_server, "--pid-file", str(pid_file), "--log", str(log_file)],
            "env": {"PYTHONPATH": str(ROOT), "MARKER": "given"},
            "timeout_s": 20,
            "cancel_grace_s": 1,
        },
        "h": {
            "url": http_url,
            "headers": {"Authorization": "Bearer ${MCP_TEST_TOKEN}"},
            "tools": ["echo", "add"],
        },
        "one": {
            "command": test_server,
            "env": {"PYTHONPATH": str(ROOT)},
            "tools": ["slow"],
            "concurrency": 1,
        },
        # Published on PyPI, written by no one here (.ci/run installs it).
        "time": {"command": [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]},
    }


@pytest.fixture(scope="module")
def stack(agentq_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("mcp")
    pid_file, log_file = tmp / "t.pid", tmp / "t.log"
    http = start_process(
        [sys.executable, "-m", "agentq.testing.mcp_server", "--http", "0", "--token", TOKEN],
        env={"PYTHONPATH": str(ROOT)},
        ready_pattern=r"listening on http://127\.0\.0\.1:\d+/mcp",
        name="mcp-http",
    )
    found = re.search(r"listening on (\S+)", http.log_text())
    assert found is not None
    procs: dict[str, ManagedProcess] = {"http": http}
    with RedisServer() as redis_server:
        env = {
            **agentq_env,
            "AGENTQ_REDIS_URL": redis_server.url,
            "AGENTQ_BROKER_URL": redis_server.url,
            "AGENTQ_MCP_SERVERS": json.dumps(_servers(pid_file, log_file, found.group(1))),
            "MCP_TEST_TOKEN": TOKEN,
        }
        fleet = LocalFleet(env, name="mcp")
        kinds = ["turns", "llm", "io"]
        try:
            started = fleet.start_workers(
                kinds, concurrency={"turns": 8, "llm": 4}, ready_timeout_s=90
            )
            procs.update(zip(kinds, started, strict=True))
            with process_env(env):
                yield Stack(Client(), procs, pid_file, log_file, redis_server.url)
        finally:
            fleet.stop()
            http.stop()


def run(stack: Stack, *calls: ScriptedCall, llm_server: Any, timeout_s: float = 60) -> list[Event]:
    key = script(llm_server, Round(tool_calls=list(calls)), Round(text="Done."))
    handle = stack.client._start_turn(f"{key} go")
    return collect(stack.client, handle.turn_id, timeout_s=timeout_s)


def results(stack: Stack, events: list[Event]) -> dict[str, dict[str, Any]]:
    """Each call's tool message content (parsed where it is JSON) and status, by tool name."""
    view = stack.client.get(events[0].turn_id)
    out = {}
    by_id = {r["call_id"]: r for r in view["invocations"]}
    for msg in view["history"]:
        if msg.get("role") == "tool":
            rec = by_id[msg["tool_call_id"]]
            try:
                content: Any = json.loads(msg["content"])
            except ValueError:
                content = msg["content"]
            out[rec["tool"]] = {"status": rec["status"], "content": content}
    return out


def server_pid(stack: Stack) -> int:
    return int(stack.pid_file.read_text())


def test_tools_are_listed_as_server__tool_with_schemas(stack: Stack) -> None:
    shared = stack.client._store.redis.hgetall(k.MCP_TOOLS)
    listings = {
        (key.decode() if isinstance(key, bytes) else key): json.loads(value)
        for key, value in shared.items()
    }
    assert set(listings) == {"t", "h", "one", "time"}
    names = {t["name"] for t in listings["t"]["tools"]}
    assert {"slow", "stubborn", "crash", "add", "whoami"} <= names
    add = next(t for t in listings["t"]["tools"] if t["name"] == "add")
    assert add["description"] == "Add two numbers." and add["read_only"] is True
    assert add["input_schema"]["required"] == ["a", "b"]
    assert {t["name"] for t in listings["time"]["tools"]} >= {"get_current_time"}
    assert all(not entry["error"] for entry in listings.values()), listings
    # Listed by the I/O worker alone, on the session it holds for the calls: the server
    # started once, under it; turn and stream workers only read the listing.
    starts = [line for line in stack.log_file.read_text().splitlines() if line.endswith("started")]
    assert len(starts) == 1, starts
    ancestors = {p.pid for p in psutil.Process(int(starts[0].split()[0])).parents()}
    assert stack.procs["io"].pid in ancestors


def test_calls_run_with_progress_results_and_schema_checks(stack: Stack, llm_server) -> None:
    events = run(
        stack,
        ScriptedCall(name="t__slow", arguments={"seconds": 1.2, "steps": 3}),
        ScriptedCall(name="t__add", arguments={"a": 2, "b": 3}),
        ScriptedCall(name="time__get_current_time", arguments={"timezone": "UTC"}),
        ScriptedCall(name="h__echo", arguments={"text": "over http"}),
        ScriptedCall(name="t__whoami", arguments={}),
        ScriptedCall(name="t__fail", arguments={"message": "it broke"}),
        ScriptedCall(name="t__echo", arguments={"text": 7}),
        llm_server=llm_server,
    )
    assert events[-1].type == "turn_finished", events[-1]
    got = results(stack, events)
    assert got["t__slow"] == {"status": "ok", "content": {"result": "waited 1.2 s"}}
    assert got["t__add"] == {"status": "ok", "content": {"total": 5.0}}
    assert got["time__get_current_time"]["status"] == "ok"
    assert got["time__get_current_time"]["content"]["timezone"] == "UTC"
    assert got["h__echo"]["content"] == {"result": "over http"}
    # The server's environment is only what its config gives.
    env = got["t__whoami"]["content"]["env"]
    assert "MARKER" in env and "HOME" not in env
    assert not [n for n in env if n.startswith(("AGENTQ_", "MCP_TEST"))], env
    assert got["t__fail"]["status"] == "error"
    assert "it broke" in got["t__fail"]["content"]["error"]
    # Checked against the input schema: never sent.
    assert got["t__echo"]["status"] == "error"
    assert "invalid arguments" in got["t__echo"]["content"]["error"]
    echo_call = next(
        e for e in events if e.type == "tool_finished" and e.fields["tool"] == "t__echo"
    )
    assert not [
        e
        for e in events
        if e.type == "tool_started" and e.fields.get("call_id") == echo_call.fields["call_id"]
    ]
    progress = [
        e.fields
        for e in events
        if e.type == "tool_progress"
        and e.fields["tool"] == "t__slow"
        and e.fields["source"] == "tool"
    ]
    # Published from the worker's store threads: in any order.
    assert sorted(p["message"] for p in progress) == ["step 1 of 3", "step 2 of 3", "step 3 of 3"]
    assert sorted(p["pct"] for p in progress) == [33.3, 66.7, 100.0]


def test_abort_sends_cancelled_and_settles_cancelled(stack: Stack, llm_server) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="t__slow", arguments={"seconds": 40, "steps": 40})]),
        Round(text="Done."),
    )
    handle = stack.client._start_turn(f"{key} go")
    wait_event(stack.client, handle.turn_id, "tool_progress", tool="t__slow", source="tool")
    stack.client.abort(handle.turn_id, handle.token)
    events = collect(stack.client, handle.turn_id, timeout_s=30)
    assert events[-1].type == "turn_aborted"
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["cancelled"]
    # The server heard notifications/cancelled: its tool stopped.
    wait_for(lambda: "slow cancelled" in stack.log_file.read_text(), timeout_s=10)


def test_a_tool_the_server_adds_is_offered_once_it_says_its_list_changed(
    stack: Stack, llm_server
) -> None:
    name = f"extra_{uuid.uuid4().hex[:6]}"
    events = run(
        stack, ScriptedCall(name="t__grow", arguments={"name": name}), llm_server=llm_server
    )
    assert results(stack, events)["t__grow"]["status"] == "ok"

    def listed() -> bool:
        raw = stack.client._store.redis.hget(k.MCP_TOOLS, "t")
        return name in {t["name"] for t in json.loads(raw)["tools"]}

    # The I/O worker heard notifications/tools/list_changed and shared the new listing.
    wait_for(listed, timeout_s=10)
    # Turn workers read it within seconds; the I/O worker runs the new tool's task.
    deadline = time.monotonic() + 20
    while True:
        events = run(stack, ScriptedCall(name=f"t__{name}", arguments={}), llm_server=llm_server)
        got = results(stack, events)[f"t__{name}"]
        if got["status"] == "ok" or time.monotonic() > deadline:
            break
        assert "unknown tool" in got["content"]["error"], got
    assert got == {"status": "ok", "content": {"result": name}}


def test_a_server_that_ignores_the_hard_limit_is_killed_and_started_again(
    stack: Stack, llm_server
) -> None:
    run(stack, ScriptedCall(name="t__echo", arguments={"text": "up"}), llm_server=llm_server)
    before = server_pid(stack)
    events = run(
        stack,
        ScriptedCall(name="t__stubborn", arguments={"seconds": 60, "_meta": {"timeout_s": 2}}),
        llm_server=llm_server,
    )
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["timeout"]
    assert finished[0].fields["duration_ms"] < 6000
    # It could not answer a ping: its process is stopped, not left running.
    wait_for(lambda: not psutil.pid_exists(before), timeout_s=15)
    events = run(
        stack, ScriptedCall(name="t__echo", arguments={"text": "again"}), llm_server=llm_server
    )
    assert results(stack, events)["t__echo"] == {"status": "ok", "content": {"result": "again"}}
    assert server_pid(stack) != before


def test_a_server_that_crashes_settles_error_naming_it_and_restarts(
    stack: Stack, llm_server
) -> None:
    events = run(stack, ScriptedCall(name="t__crash", arguments={}), llm_server=llm_server)
    got = results(stack, events)["t__crash"]
    assert got["status"] == "error"
    assert "MCP server 't'" in got["content"]["error"], got
    redis = stack.client._store.redis
    wait_for(lambda: server_health(redis)["t"]["ok"] is False, timeout_s=5)
    events = run(
        stack, ScriptedCall(name="t__echo", arguments={"text": "back"}), llm_server=llm_server
    )
    assert results(stack, events)["t__echo"]["status"] == "ok"
    wait_for(lambda: server_health(redis)["t"]["ok"] is True, timeout_s=5)


def test_a_numeric_concurrency_runs_one_call_at_a_time_fleet_wide(stack: Stack, llm_server) -> None:
    events = run(
        stack,
        ScriptedCall(name="one__slow", arguments={"seconds": 1.0, "steps": 1}),
        ScriptedCall(name="one__slow", arguments={"seconds": 1.01, "steps": 1}),
        llm_server=llm_server,
    )
    finished = sorted(e.ts for e in events if e.type == "tool_finished")
    assert len(finished) == 2 and finished[1] - finished[0] >= 0.9, finished


def test_a_server_question_during_a_call_is_asked_on_the_turn(stack: Stack, llm_server) -> None:
    """MCP elicitation: the server's `elicitation/create` becomes an `input` question on
    the call's turn, checked against the requested schema; the answer, or a decline,
    goes back to the server."""
    for answer, decision, said in (
        ('{"size": "M"}', "approve", "ship M"),
        (None, "deny", "no size: decline"),
    ):
        key = script(
            llm_server,
            Round(tool_calls=[ScriptedCall(name="t__pick_size", arguments={})]),
            Round(text="Done."),
        )
        h = stack.client._start_turn(f"{key} go")
        asked = wait_event(stack.client, h.turn_id, "interaction_requested")
        assert (
            asked.fields["kind"] == "input" and asked.fields["prompt"] == "Which size should ship?"
        )
        assert asked.fields["answer_schema"]["required"] == ["size"]
        rid = str(asked.fields["request_id"])
        if answer is not None:
            with pytest.raises(AnswerInvalid):
                stack.client.answer(h.turn_id, rid, h.token, "approve", '{"colour": "red"}')
        stack.client.answer(h.turn_id, rid, h.token, decision, answer)
        events = collect(stack.client, h.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished"
        got = results(stack, events)["t__pick_size"]
        assert got == {"status": "ok", "content": {"result": said}}


def test_no_server_outlives_its_io_worker_killed_outright(stack: Stack, llm_server) -> None:
    run(stack, ScriptedCall(name="t__echo", arguments={"text": "up"}), llm_server=llm_server)
    pid = server_pid(stack)
    worker = psutil.Process(pid).parent()
    assert worker is not None
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pid), timeout_s=10)
