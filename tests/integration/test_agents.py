"""Agents through real workers: per-agent model, instructions and tools; agents as tools."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from agentq.api import Client
from agentq.errors import UnknownAgent
from agentq.events import Event
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.models import parse_stream_id
from agentq.state.listing import TurnLister
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, first_user_text
from tests.helpers import agentq_cli as agentq
from tests.helpers import (
    assert_valid_history,
    calls,
    collect,
    run_dev_once,
    script,
    wait_event,
)

pytestmark = pytest.mark.integration


def requests_for(llm_server: Any, key: str) -> list[dict[str, Any]]:
    return [r for r in llm_server.requests if first_user_text(r["messages"]).startswith(key)]


def tool_names(request: dict[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in request.get("tools") or []}


def own(events: list[Event]) -> list[Event]:
    """The turn's own events, without its sub-agents' relayed ones."""
    return [e for e in events if not e.path]


def started_event(events: list[Event]) -> Event:
    (started,) = [e for e in own(events) if e.type == "tool_started"]
    return started


def child_of(events: list[Event]) -> str:
    started = [e for e in own(events) if e.type == "subturn_started"]
    assert len(started) == 1, [e.type for e in events]
    return str(started[0].fields["child_turn_id"])


def test_two_agents_get_their_own_model_instructions_and_tools(
    fleet, llm_server, client: Client
) -> None:
    runs = {}
    for agent, tool in (("t_echoer", "echo"), ("t_sleeper", "sleep")):
        args = {"text": "hi"} if tool == "echo" else {"seconds": 0.1}
        key = script(llm_server, Round(tool_calls=calls((tool, args))), Round(text="ok"))
        runs[agent] = (key, client._start_turn(key, agent=agent))
    for agent, (key, handle) in runs.items():
        events = collect(client, handle.turn_id)
        assert events[0].type == "turn_started" and events[0].fields["agent"] == agent
        assert events[-1].type == "turn_finished", events[-1]
        finished = [e for e in events if e.type == "tool_finished"]
        assert [e.fields["status"] for e in finished] == ["ok"]
        assert client.get(handle.turn_id)["state"]["agent"] == agent
        sent = requests_for(llm_server, key)
        assert len(sent) == 2
        assert {r["model"] for r in sent} == {"model-" + agent[2:]}
        assert all(
            r["messages"][0] == {"role": "system", "content": f"You are {agent}."} for r in sent
        )
        # The instructions are sent, not kept: the turn's history starts with the prompt.
        assert client.get(handle.turn_id)["history"][0]["role"] == "user"
    assert tool_names(requests_for(llm_server, runs["t_echoer"][0])[0]) == {"echo"}
    assert tool_names(requests_for(llm_server, runs["t_sleeper"][0])[0]) == {"sleep", "hang"}


def test_a_turn_without_an_agent_keeps_every_tool_and_no_system_message(
    fleet, llm_server, client: Client
) -> None:
    key = script(llm_server, Round(text="plain"))
    handle = client._start_turn(key)
    events = collect(client, handle.turn_id)
    assert events[0].fields["agent"] is None and events[-1].type == "turn_finished"
    (sent,) = requests_for(llm_server, key)
    assert sent["messages"][0]["role"] == "user"
    assert {"echo", "sleep", "hang"} <= tool_names(sent)


def test_a_call_outside_the_agents_tools_settles_error_and_never_runs(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("sleep", {"seconds": 0.1}), ("echo", {"text": "in"}))),
        Round(text="ok"),
    )
    handle = client._start_turn(key, agent="t_echoer")
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished"
    assert [e.fields["tool"] for e in events if e.type == "tool_started"] == ["echo"]
    status = {e.fields["tool"]: e.fields for e in events if e.type == "tool_finished"}
    assert status["echo"]["status"] == "ok"
    assert status["sleep"]["status"] == "error"
    assert "not available to agent 't_echoer'" in status["sleep"]["error"]


def test_an_agents_own_limits_apply_to_its_turns(fleet, llm_server, client: Client) -> None:
    four = calls(*[("sleep", {"seconds": 0.05 * (i + 1)}) for i in range(4)])
    key = script(llm_server, Round(tool_calls=four), Round(text="stopped"))
    handle = client._start_turn(key, agent="t_sleeper")  # max_calls_per_turn=3
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished"
    assert events[-1].fields["reason"] == "max_calls_per_turn"
    finished = [e.fields for e in events if e.type == "tool_finished"]
    assert sorted(f["status"] for f in finished) == ["error", "ok", "ok", "ok"]
    assert any("max_calls_per_turn=3" in (f["error"] or "") for f in finished)


def test_an_agent_called_as_a_tool_answers_through_its_child_turn(
    fleet, llm_server, client: Client
) -> None:
    child_key = script(
        llm_server, Round(tool_calls=calls(("echo", {"text": "from child"}))), Round(text="42")
    )
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_echoer", {"prompt": f"{child_key} what is it?"}))),
        Round(text="The echoer said 42."),
    )
    parent = client._start_turn(key, agent="t_boss")
    relayed = collect(client, parent.turn_id)
    events = own(relayed)
    assert events[-1].type == "turn_finished", events[-1]
    child = child_of(events)
    finished = [e for e in events if e.type == "tool_finished"]
    assert [(e.fields["tool"], e.fields["status"]) for e in finished] == [("ask_echoer", "ok")]
    # The child's own events are relayed into the parent's stream, with their type and
    # the path down to the child, between the call's start and its end.
    from_child = [e for e in relayed if e.path]
    assert {tuple(e.path) for e in from_child} == {(child,)}
    assert {e.turn_id for e in from_child} == {child}
    assert [e.type for e in from_child] == [e.type for e in collect(client, child)]
    assert relayed.index(started_event(relayed)) < relayed.index(from_child[0])
    assert relayed.index(from_child[-1]) < relayed.index(finished[0])
    assert [e.fields["tool"] for e in from_child if e.type == "tool_finished"] == ["echo"]
    (started,) = [e for e in events if e.type == "tool_started"]
    assert started.fields["child_turn_id"] == child and started.fields["agent"] == "t_echoer"
    # The parent's stream shows the agent at work, as the progress of the call it waits on.
    progress = [e for e in events if e.type == "tool_progress" and e.fields["source"] == "agent"]
    assert [e.fields["message"] for e in progress] == [
        "model round 1",
        "calling echo",
        "model round 2",
    ]
    assert {(e.fields["call_id"], e.fields["child_turn_id"]) for e in progress} == {
        (started.fields["call_id"], child)
    }
    assert events.index(progress[-1]) < events.index(finished[0])
    child_events = collect(client, child)
    assert child_events[0].fields["parent_turn_id"] == parent.turn_id
    assert child_events[0].fields["agent"] == "t_echoer"
    assert child_events[-1].type == "turn_finished"
    turn = client.get(parent.turn_id)
    history = turn["history"]
    assert_valid_history(history)
    assert [m["content"] for m in history if m["role"] == "tool"] == ["42"]
    (record,) = turn["invocations"]
    assert record["status"] == "ok" and record["task_id"] == child
    child_state = client.get(child)["state"]
    assert child_state["parent_turn_id"] == parent.turn_id and child_state["agent"] == "t_echoer"
    assert client.check_token(child, parent.token)["parent_call_id"] == record["call_id"]
    # The child's model saw the parent's argument as its prompt, with its own instructions.
    (first, _) = requests_for(llm_server, child_key)
    assert first["messages"][0]["content"] == "You are t_echoer."
    assert first["model"] == "model-echoer"


def test_an_agent_past_its_limit_settles_timeout_and_its_turn_is_aborted(
    fleet, llm_server, client: Client
) -> None:
    child_key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_sleeper", {"prompt": f"{child_key} sleep"}))),
        Round(text="It timed out."),
    )
    t0 = time.monotonic()
    parent = client._start_turn(key, agent="t_boss")
    events = own(collect(client, parent.turn_id))
    took_s = time.monotonic() - t0
    assert events[-1].type == "turn_finished", events[-1]
    finished = [e for e in events if e.type == "tool_finished"]
    assert [(e.fields["tool"], e.fields["status"]) for e in finished] == [
        ("ask_sleeper", "timeout")
    ]
    assert "did not answer within 2s" in finished[0].fields["error"]
    assert took_s < 20, took_s  # the 2 s limit, not the 60 s tool
    child_events = collect(client, child_of(events))
    assert child_events[-1].type == "turn_aborted"
    assert child_events[-1].fields["reason"] == "timeout"
    started = [e for e in child_events if e.type == "tool_started"]
    if started:  # the hang tool had started: its process is killed with the child's abort
        pid = int(started[0].fields["pid"])
        wait_for(lambda: not psutil.pid_exists(pid), 10, message=f"tool process {pid} gone")
    assert_valid_history(client.get(parent.turn_id)["history"])


def test_aborting_the_parent_aborts_the_agent_it_waits_for(
    fleet, llm_server, client: Client
) -> None:
    child_key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_waiter", {"prompt": f"{child_key} wait"}))),
    )
    parent = client._start_turn(key, agent="t_boss")
    child: str | None = None
    for ev in client.events(parent.turn_id, heartbeat_s=0.5):
        if ev is not None and ev.type == "subturn_started":
            child = str(ev.fields["child_turn_id"])
            break
    assert child is not None
    pid = 0
    for ev in client.events(child, heartbeat_s=0.5):
        if ev is not None and ev.type == "tool_started":
            pid = int(ev.fields["pid"])
            break
    assert psutil.pid_exists(pid)
    # While the child waits on its tool, the parent's call still beats (every 5 s), with
    # the child's phase: a parent's step is woken for it, no process waits.
    beat = wait_event(
        client,
        parent.turn_id,
        "tool_progress",
        timeout_s=15,
        message="calling hang",
        source="agent",
        child_turn_id=child,
        until=lambda e: int(e.fields["elapsed_ms"]) >= 4000,
    )
    assert not beat.path and beat.fields["tool"] == "ask_waiter"
    summary = TurnLister(client._store.redis).summaries([parent.turn_id])[parent.turn_id]
    assert summary["agent"] == "t_boss"
    assert [(c["tool"], c["state"]) for c in summary["current_tools"]] == [
        ("ask_waiter", "running")
    ]
    client.abort(parent.turn_id, parent.token)
    parent_events = collect(client, parent.turn_id)
    last = parent_events[-1]
    assert last.type == "turn_aborted" and not last.path
    child_last = collect(client, child)[-1]
    assert child_last.type == "turn_aborted"
    # Nothing of the child is relayed after the parent's terminal event.
    end = parse_stream_id(last.stream_id or "")
    relayed = [e for e in parent_events if e.path]
    assert relayed and all(parse_stream_id(e.stream_id or "") <= end for e in relayed)
    relayed_ids = {e.stream_id for e in relayed if e.turn_id == child}
    assert (child_last.stream_id in relayed_ids) == (
        parse_stream_id(child_last.stream_id or "") <= end
    )
    wait_for(lambda: not psutil.pid_exists(pid), 10, message=f"tool process {pid} gone")
    turn = client.get(parent.turn_id)
    assert [r["status"] for r in turn["invocations"]] == ["cancelled"]
    assert_valid_history(turn["history"])
    assert_valid_history(client.get(child)["history"])


def test_agents_nest_two_levels_deep(fleet, llm_server, client: Client) -> None:
    leaf_key = script(
        llm_server, Round(tool_calls=calls(("echo", {"text": "leaf"}))), Round(text="leaf says hi")
    )
    middle_key = script(
        llm_server,
        Round(tool_calls=calls(("ask_echoer", {"prompt": f"{leaf_key} go"}))),
        Round(text="middle relays: leaf says hi"),
    )
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_middle", {"prompt": f"{middle_key} go"}))),
        Round(text="top is done"),
    )
    top = client._start_turn(key, agent="t_top")
    events = collect(client, top.turn_id)
    assert events[-1].type == "turn_finished" and events[-1].fields["content"] == "top is done"
    middle = child_of(events)
    middle_events = collect(client, middle, depth=0)
    leaf = child_of(middle_events)
    leaf_events = collect(client, leaf)
    # One level is relayed by default; two when asked, each event with its full path.
    assert {tuple(e.path) for e in events} == {(), (middle,)}
    deep = collect(client, top.turn_id, depth=2)
    assert {tuple(e.path) for e in deep} == {(), (middle,), (middle, leaf)}
    assert [e.type for e in deep if e.path == [middle, leaf]] == [e.type for e in leaf_events]
    assert [e.type for e in deep if e.path == [middle]] == [e.type for e in middle_events]
    assert not [e for e in collect(client, top.turn_id, depth=0) if e.path]
    assert middle_events[0].fields["parent_turn_id"] == top.turn_id
    assert leaf_events[0].fields["parent_turn_id"] == middle
    assert leaf_events[0].fields["agent"] == "t_echoer"
    tool_msgs = [m for m in client.get(top.turn_id)["history"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["middle relays: leaf says hi"]
    middle_tools = [m for m in client.get(middle)["history"] if m["role"] == "tool"]
    assert [m["content"] for m in middle_tools] == ["leaf says hi"]


def test_a_failed_child_settles_the_call_as_error(fleet, llm_server, client: Client) -> None:
    child_key = script(llm_server, Round(fault="http_400", fault_message="child model says no"))
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_echoer", {"prompt": f"{child_key} fail"}))),
        Round(text="The child failed."),
    )
    parent = client._start_turn(key, agent="t_boss")
    events = own(collect(client, parent.turn_id))
    assert events[-1].type == "turn_finished"
    (finished,) = [e for e in events if e.type == "tool_finished"]
    assert finished.fields["status"] == "error"
    assert "child model says no" in finished.fields["error"]


def test_a_child_whose_state_redis_lost_settles_the_call_as_error(
    fleet, llm_server, client: Client
) -> None:
    """Ended by `end_lost_turn`, the child settles nothing on its parent: the parent's look
    settles the call with the child's error and the turn goes on."""
    from agentq import constants as k
    from agentq.state.base import STATE_LOST_MESSAGE

    child_key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 30}))))
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_waiter", {"prompt": f"{child_key} wait"}))),
        Round(text="The child was lost."),
    )
    parent = client._start_turn(key, agent="t_boss")
    child = str(wait_event(client, parent.turn_id, "subturn_started").fields["child_turn_id"])
    wait_event(client, child, "tool_started")
    store = client._store
    store.redis.delete(k.turn_key(child))  # as a failover that lost the child's writes
    assert store.end_lost_turn(child)
    store.wake_by(parent.turn_id, 0)
    events = own(collect(client, parent.turn_id))
    assert events[-1].type == "turn_finished", events[-1].fields
    (finished,) = [e for e in events if e.type == "tool_finished"]
    assert finished.fields["status"] == "error"
    assert STATE_LOST_MESSAGE in finished.fields["error"]
    assert_valid_history(client.get(parent.turn_id)["history"])


def test_listings_show_the_agent(fleet, llm_server, client: Client, agentq_env) -> None:
    # Held by a hanging tool until the abort below: listed as running however slow the CLI.
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    handle = client._start_turn(key, agent="t_sleeper")
    wait_for(
        lambda: any(
            t["turn_id"] == handle.turn_id and t["agent"] == "t_sleeper" and t["current_tools"]
            for t in client.active()
        ),
        30,
        message="the turn listed as active with its agent",
    )
    out = agentq(agentq_env, "turns", "--agent", "t_sleeper", "--json")
    assert out.returncode == 0, out.stderr
    listed = {t["turn_id"]: t for t in json.loads(out.stdout)["turns"]}
    assert listed[handle.turn_id]["agent"] == "t_sleeper"
    assert listed[handle.turn_id]["status"] == "running"
    client.abort(handle.turn_id, handle.token)
    assert collect(client, handle.turn_id)[-1].type == "turn_aborted"


# -- unknown agents ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client())) as server:
        yield server


def test_unknown_agent_over_http_is_422_with_the_known_agents(
    gateway: BackgroundServer, llm_server
) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        r = http.post("/v1/turns", json={"prompt": "x", "agent": "nobody"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] == "UnknownAgent" and "nobody" in err["message"]
        assert {"t_echoer", "t_boss", "lead", "researcher"} <= set(err["known_agents"])
        key = script(llm_server, Round(text="fine"))
        ok = http.post("/v1/turns", json={"prompt": key, "agent": "t_echoer"})
        assert ok.status_code == 202, ok.text


def test_the_gateway_lists_the_agents_with_their_models_and_tools(
    gateway: BackgroundServer,
) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        r = http.get("/v1/agents")
    assert r.status_code == 200, r.text
    agents = {a["name"]: a for a in r.json()["agents"]}
    assert agents["t_echoer"] == {
        "name": "t_echoer",
        "model": "model-echoer",
        "tools": ["echo"],
        "description": "",
        "output_schema": None,
    }
    assert agents["t_judge"]["output_schema"]["title"] == "Verdict"
    assert {"t_boss", "lead", "researcher"} <= set(agents)


def test_unknown_agent_from_the_cli_exits_2(fleet, agentq_env) -> None:
    out = agentq(agentq_env, "run", "--agent", "nobody", "hello")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "unknown agent 'nobody'" in out.stderr and "t_echoer" in out.stderr


def test_unknown_agent_from_python_raises_with_the_known_ones(fleet, client: Client) -> None:
    with pytest.raises(UnknownAgent) as info:
        client._start_turn("hello", agent="nobody")
    assert info.value.agent == "nobody"
    assert "t_boss" in info.value.known


def test_agentq_dev_once_runs_the_demo_agents() -> None:
    """The demo agents (agentq.testing.agents): the lead asks the researcher, as a child turn."""
    rc, out = run_dev_once("--no-flower", "--agent", "lead", name="agentq-dev-agents")
    assert rc == 0, out
    assert "Asking the researcher." in out
    assert "The researcher found that agentq runs agent turns as Celery jobs." in out
    assert re.search(r"researcher\s+[\d.]+s\s+ok", out), out
    assert "turn finished" in out and "1 ok" in out, out
