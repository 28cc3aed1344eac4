"""MCP servers no one here wrote, and servers that send what no good one would: a fleet
with the protocol's reference server from npm (`@modelcontextprotocol/server-everything`,
hyphenated tool names) and five hostile stdio servers (tests/mcp_hostile_server.py) starts,
and each bad listing costs only its own tool or server.

The stack is the module's own (its own Redis, real turn, stream and I/O workers, a gateway
for `GET /v1/mcp/servers`), as in test_mcp_tools.py.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.events import Event
from agentq.gateway import create_app
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess, wait_for
from agentq.local.redis_server import RedisServer
from agentq.mcp.listing import tool_name
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import collect, process_env, script, wait_event
from tests.mcp_published import everything_argv

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "ops-" + secrets.token_urlsafe(16)
HOSTILE = [sys.executable, "-m", "tests.mcp_hostile_server"]


@dataclass
class Stack:
    client: Client
    procs: dict[str, ManagedProcess]
    http: httpx.Client
    everything: bool


def _servers(everything: list[str] | None) -> dict[str, Any]:
    env = {"PYTHONPATH": str(ROOT)}
    servers: dict[str, Any] = {
        "rough": {"command": [*HOSTILE, "listing"], "env": env, "timeout_s": 60},
        "mute": {"command": [*HOSTILE, "mute"], "env": env, "start_timeout_s": 3},
        "die": {"command": [*HOSTILE, "die"], "env": env},
        "garbage": {"command": [*HOSTILE, "garbage"], "env": env},
        "endless": {"command": [*HOSTILE, "endless"], "env": env},
    }
    if everything is not None:
        servers["everything"] = {
            "command": everything,
            "env": {"PATH": os.environ.get("PATH", "")},
            "timeout_s": 30,
            "cancel_grace_s": 2,
        }
    return servers


@pytest.fixture(scope="module")
def stack(agentq_env: dict[str, str]) -> Iterator[Stack]:
    try:
        everything: list[str] | None = everything_argv()
    except pytest.skip.Exception:
        everything = None
    with RedisServer() as redis_server:
        env = {
            **agentq_env,
            "AGENTQ_REDIS_URL": redis_server.url,
            "AGENTQ_BROKER_URL": redis_server.url,
            "AGENTQ_MCP_SERVERS": json.dumps(_servers(everything)),
        }
        fleet = LocalFleet(env, name="mcpub")
        # Every kind: each registers a task per tool, and a hyphen once stopped them all.
        kinds = ["turns", "llm", "io", "tools"]
        try:
            started = fleet.start_workers(
                kinds, concurrency={"turns": 4, "llm": 4, "tools": 1}, ready_timeout_s=90
            )
            procs = dict(zip(kinds, started, strict=True))
            with process_env(env):
                client = Client(load_settings(admin_keys=f"ops={ADMIN_KEY}"))
                with (
                    BackgroundServer(create_app(client)) as gateway,
                    httpx.Client(base_url=gateway.url, timeout=10) as http,
                ):
                    yield Stack(Client(), procs, http, everything is not None)
        finally:
            fleet.stop()


def run(stack: Stack, *calls: ScriptedCall, llm_server: Any, timeout_s: float = 60) -> list[Event]:
    key = script(llm_server, Round(tool_calls=list(calls)), Round(text="Done."))
    handle = stack.client._start_turn(f"{key} go")
    return collect(stack.client, handle.turn_id, timeout_s=timeout_s)


def results(stack: Stack, events: list[Event]) -> dict[str, dict[str, Any]]:
    """Each call's tool message content (parsed where it is JSON) and status, by tool name."""
    view = stack.client.get(events[0].turn_id)
    by_id = {r["call_id"]: r for r in view["invocations"]}
    out = {}
    for msg in view["history"]:
        if msg.get("role") == "tool":
            rec = by_id[msg["tool_call_id"]]
            try:
                content: Any = json.loads(msg["content"])
            except ValueError:
                content = msg["content"]
            out[rec["tool"]] = {"status": rec["status"], "content": content}
    return out


def mcp_servers(stack: Stack) -> dict[str, dict[str, Any]]:
    res = stack.http.get("/v1/mcp/servers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert res.status_code == 200, res.text
    return {s["name"]: s for s in res.json()["servers"]}


def needs_everything(stack: Stack) -> None:
    if not stack.everything:
        everything_argv()  # skips, saying what is missing


DOTTED = tool_name("rough", "dotted.name")


def test_bad_listings_cost_only_their_tool_or_server(stack: Stack) -> None:
    assert stack.http.get("/v1/mcp/servers").status_code == 401
    servers = mcp_servers(stack)
    rough = servers["rough"]
    assert not rough["error"]
    assert {t["name"] for t in rough["tools"]} == {
        "rough__get-sum",
        DOTTED,
        "rough__wordy",
        "rough__churn",
    }
    assert {t["tool"] for t in rough["tools"]} >= {"get-sum", "dotted.name"}
    why = {r["tool"]: r["why"] for r in rough["refused"]}
    assert why[""] == "it has no name"
    assert why["twice"] == "listed 2 times"
    assert "not JSON Schema" in why["not-schema"]
    assert "bytes long" in why["huge-schema"]
    assert any("300 characters long" in w for w in why.values()), why
    assert "did not answer initialize within 3 s" in servers["mute"]["error"]
    assert "cannot start" in servers["die"]["error"]
    assert "tools/list failed" in servers["garbage"]["error"]
    assert "its listing does not end (cursor again again)" in servers["endless"]["error"]
    for name in ("mute", "die", "garbage", "endless"):
        assert servers[name]["tools"] == [] and servers[name]["health"]["ok"] is False
    # The 10 MB description was cut before it was shared.
    listing = json.loads(stack.client._store.redis.hget(k.MCP_TOOLS, "rough"))
    wordy = next(t for t in listing["tools"] if t["name"] == "wordy")
    assert len(wordy["description"]) < 5000 and "[cut: " in wordy["description"]
    # The console's panel shows them too.
    panel = stack.http.get("/v1/capacity", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert panel.status_code == 200, panel.text
    assert "twice" in {r["tool"] for r in panel.json()["mcp_servers"]["rough"]["refused"]}
    assert panel.json()["mcp_servers"]["mute"]["ok"] is False
    # Logged once per process, with the reason.
    io_log = stack.procs["io"].log_text()
    assert io_log.count("tool twice is not offered: listed 2 times") == 1, io_log[-3000:]


def test_hyphenated_and_dotted_tools_run_as_calls(stack: Stack, llm_server: Any) -> None:
    events = run(
        stack,
        ScriptedCall(name="rough__get-sum", arguments={"text": "hyphen"}),
        ScriptedCall(name=DOTTED, arguments={"text": "dot"}),
        llm_server=llm_server,
    )
    assert events[-1].type == "turn_finished", events[-1]
    got = results(stack, events)
    assert got["rough__get-sum"]["status"] == "ok"
    # The server's text answer is JSON: the model reads it as it came.
    assert "get-sum" in json.dumps(got["rough__get-sum"]["content"]), got
    assert got[DOTTED]["status"] == "ok"
    assert "dotted.name" in json.dumps(got[DOTTED]["content"]), got


def test_a_list_changed_while_calls_run_costs_them_nothing(stack: Stack, llm_server: Any) -> None:
    events = run(
        stack,
        ScriptedCall(name="rough__churn", arguments={"seconds": 2}),
        ScriptedCall(name="rough__get-sum", arguments={"text": "beside"}),
        llm_server=llm_server,
    )
    got = results(stack, events)
    assert got["rough__churn"]["status"] == "ok" and got["rough__get-sum"]["status"] == "ok"

    def listed() -> bool:
        raw = stack.client._store.redis.hget(k.MCP_TOOLS, "rough")
        return "late-tool" in {t["name"] for t in json.loads(raw)["tools"]}

    wait_for(listed, timeout_s=15)
    deadline = time.monotonic() + 20
    while True:
        events = run(
            stack, ScriptedCall(name="rough__late-tool", arguments={}), llm_server=llm_server
        )
        late = results(stack, events)["rough__late-tool"]
        if late["status"] == "ok" or time.monotonic() > deadline:
            break
    assert late["status"] == "ok", late
    # The new listing kept its refusals.
    assert "twice" in {r["tool"] for r in mcp_servers(stack)["rough"]["refused"]}


def test_the_reference_server_s_hyphenated_tools_run(stack: Stack, llm_server: Any) -> None:
    needs_everything(stack)
    names = {t["name"] for t in mcp_servers(stack)["everything"]["tools"]}
    assert {
        "everything__echo",
        "everything__get-sum",
        "everything__get-annotated-message",
        "everything__trigger-long-running-operation",
    } <= names
    events = run(
        stack,
        ScriptedCall(name="everything__get-sum", arguments={"a": 2, "b": 3}),
        ScriptedCall(name="everything__echo", arguments={"message": "hi there"}),
        llm_server=llm_server,
    )
    assert events[-1].type == "turn_finished", events[-1]
    got = results(stack, events)
    assert got["everything__get-sum"]["status"] == "ok"
    assert "5" in json.dumps(got["everything__get-sum"]["content"])
    assert got["everything__echo"]["status"] == "ok"
    assert "hi there" in json.dumps(got["everything__echo"]["content"])


def test_the_reference_server_s_long_operation_reports_progress(
    stack: Stack, llm_server: Any
) -> None:
    needs_everything(stack)
    events = run(
        stack,
        ScriptedCall(
            name="everything__trigger-long-running-operation",
            arguments={"duration": 2, "steps": 4},
        ),
        llm_server=llm_server,
    )
    got = results(stack, events)["everything__trigger-long-running-operation"]
    assert got["status"] == "ok", got
    progress = sorted(
        e.fields["progress"]
        for e in events
        if e.type == "tool_progress" and e.fields.get("source") == "tool"
    )
    assert progress == [1, 2, 3, 4], progress


def test_the_reference_server_s_long_operation_meets_a_hard_limit(
    stack: Stack, llm_server: Any
) -> None:
    needs_everything(stack)
    events = run(
        stack,
        ScriptedCall(
            name="everything__trigger-long-running-operation",
            arguments={"duration": 60, "steps": 60, "_meta": {"timeout_s": 2}},
        ),
        llm_server=llm_server,
    )
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["timeout"]
    assert finished[0].fields["duration_ms"] < 10_000
    again = run(
        stack,
        ScriptedCall(name="everything__get-sum", arguments={"a": 1, "b": 1}),
        llm_server=llm_server,
    )
    assert results(stack, again)["everything__get-sum"]["status"] == "ok"


def test_the_reference_server_s_long_operation_is_aborted(stack: Stack, llm_server: Any) -> None:
    needs_everything(stack)
    name = "everything__trigger-long-running-operation"
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name=name, arguments={"duration": 60, "steps": 60})]),
        Round(text="Done."),
    )
    handle = stack.client._start_turn(f"{key} go")
    wait_event(stack.client, handle.turn_id, "tool_progress", tool=name, source="tool")
    stack.client.abort(handle.turn_id, handle.token)
    events = collect(stack.client, handle.turn_id, timeout_s=30)
    assert events[-1].type == "turn_aborted"
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["cancelled"]
