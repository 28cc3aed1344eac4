"""Agent definitions, their checks, their plans, and a child's end settling its parent's call."""

from __future__ import annotations

import json
from collections.abc import Iterator

import fakeredis
import pytest
from pydantic import BaseModel

import agentq.testing.tools as demo
from agentq import constants as k
from agentq.agents import (
    Agent,
    all_agents,
    check_agents,
    publish_agents,
    published_agent_details,
    require_known,
    unregister_agent,
)
from agentq.config import load_settings
from agentq.errors import AgentDefinitionError, UnknownAgent
from agentq.models import ToolCall, TurnStatus
from agentq.orchestrator.plan import plan_call
from agentq.state.store import TurnStore
from agentq.testing.openai_server import script_key
from agentq.tools.results import error_result
from tests.unit.state.support import Woken


@pytest.fixture(autouse=True)
def only_new_agents() -> Iterator[None]:
    before = set(all_agents())
    yield
    for name in set(all_agents()) - before:
        unregister_agent(name)


def test_tools_are_names_and_none_unless_listed() -> None:
    a = Agent(name="u_a", tools=[demo.echo, "sleep"])
    assert a.tool_names() == ["echo", "sleep"]
    assert [t.openai_schema()["function"]["name"] for t in a.offered_tools()] == ["echo", "sleep"]
    bare = Agent(name="u_none")
    assert bare.tool_names() == [] and bare.offered_tools() == []


def test_two_agents_of_one_name_are_refused_and_the_same_one_twice_is_not() -> None:
    first = Agent(name="u_twice", instructions="One.", tools=[demo.echo])
    assert Agent(name="u_twice", instructions="One.", tools=["echo"]) == first
    with pytest.raises(AgentDefinitionError) as caught:
        Agent(name="u_twice", instructions="Two.")
    assert caught.value.field == "name" and "u_twice" in caught.value.message
    assert all_agents()["u_twice"] == first


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "has space"}, "name"),
        ({"name": "u_x", "max_calls_per_turn": 0}, "max_calls_per_turn"),
        ({"name": "u_x", "stream_duration_s": -1}, "stream_duration_s"),
        ({"name": "u_x", "tools": "echo"}, "tools"),
        ({"name": "u_x", "tools": [42]}, "tools"),
        ({"name": "u_x", "temperature": 0.3}, "temperature"),
        ({"name": "u_x", "output_type": dict}, "output_type"),
    ],
)
def test_a_bad_field_names_the_agent_and_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(AgentDefinitionError) as info:
        Agent(**fields)  # type: ignore[arg-type]
    assert info.value.field == field
    assert info.value.agent == fields["name"]
    assert field in info.value.message


def test_an_output_type_asks_the_model_for_its_schema() -> None:
    class Answer(BaseModel):
        value: int

    plain = Agent(name="u_plain", instructions="Be brief.")
    assert plain.system_message() == "Be brief."
    typed = Agent(name="u_typed", instructions="Be brief.", output_type=Answer)
    first, schema = typed.system_message().split("\n\n")
    assert first == "Be brief."
    assert json.loads(schema.split(": ", 1)[1]) == Answer.model_json_schema()
    bare = Agent(name="u_bare", output_type=Answer)
    assert bare.system_message().startswith("Answer with only one JSON object")


def test_the_loaded_set_is_checked_whole() -> None:
    Agent(name="u_typo", tools=["echo", "ecoh"])
    with pytest.raises(AgentDefinitionError) as info:
        check_agents()
    assert info.value.agent == "u_typo" and info.value.field == "tools"
    assert "'ecoh'" in info.value.message
    unregister_agent("u_typo")
    Agent(name="u_appr", tools=["echo"], approval={"sleep": "ask"})
    with pytest.raises(AgentDefinitionError, match="approval"):
        check_agents()
    unregister_agent("u_appr")
    helper = Agent(name="u_helper", tools=["echo"])
    Agent(name="u_clash", tools=[helper.as_tool(name="echo")])
    with pytest.raises(AgentDefinitionError, match="has the name of a @tool"):
        check_agents()
    unregister_agent("u_clash")
    Agent(name="u_lead", tools=[helper.as_tool()])
    check_agents()
    unregister_agent("u_helper")
    with pytest.raises(AgentDefinitionError, match="as_tool of unknown agent 'u_helper'"):
        check_agents()
    unregister_agent("u_lead")
    # ask_user named in tools without the flag was accepted and offered to nobody.
    Agent(name="u_asks", tools=["echo", "ask_user"])
    with pytest.raises(AgentDefinitionError, match="offered with ask_user=True"):
        check_agents()
    unregister_agent("u_asks")
    Agent(name="u_asks", tools=["echo", "ask_user"], ask_user=True)
    check_agents()
    assert [t.name for t in all_agents()["u_asks"].offered_tools()] == ["echo", "ask_user"]
    unregister_agent("u_asks")


def test_as_tool_is_offered_with_a_prompt_argument() -> None:
    helper = Agent(name="u_helper", description="Helps.")
    t = helper.as_tool(timeout_s=5)
    assert (t.name, t.agent, t.description, t.timeout_s) == ("u_helper", "u_helper", "Helps.", 5)
    schema = t.openai_schema()["function"]
    assert schema["parameters"]["required"] == ["prompt"]
    with pytest.raises(AgentDefinitionError, match=r"as_tool\.timeout_s"):
        helper.as_tool(timeout_s=-1)


def test_settings_carry_the_agents_overrides() -> None:
    base = load_settings()
    a = Agent(name="u_lim", max_calls_per_turn=3, stream_idle_timeout_ms=500, stream_duration_s=9)
    s = a.settings_for(base)
    assert (s.max_calls_per_turn, s.stream_idle_timeout_ms, s.stream_duration_s) == (3, 500, 9)
    assert s.tool_timeout_s == base.tool_timeout_s
    assert Agent(name="u_plain").settings_for(base) is base


def test_plans_refuse_tools_outside_the_set_and_route_agent_calls() -> None:
    helper = Agent(name="u_helper")
    lead = Agent(
        name="u_lead",
        tools=["echo", helper.as_tool(name="ask", timeout_s=7)],
        approval={"echo": "ask"},
        approval_default="deny",
    )
    refused = plan_call(ToolCall(id="c1", name="sleep", arguments="{}"), agent=lead)
    assert refused.refusal is not None
    assert "not available to agent 'u_lead'" in refused.refusal and "echo, ask" in refused.refusal
    echo = plan_call(ToolCall(id="c2", name="echo", arguments='{"text": "x"}'), agent=lead)
    assert echo.refusal is None and echo.approval == "ask" and echo.approval_default == "deny"
    sub = plan_call(ToolCall(id="c3", name="ask", arguments='{"prompt": "go"}'), agent=lead)
    assert sub.refusal is None and sub.subturn_agent == "u_helper"
    assert sub.arguments == {"prompt": "go"} and sub.timeout_s == 7
    hinted = plan_call(
        ToolCall(id="c4", name="ask", arguments='{"prompt": "go", "_meta": {"timeout_s": 60}}'),
        agent=lead,
    )
    assert hinted.timeout_s == 7  # clamped to the agent tool's limit
    bad = plan_call(ToolCall(id="c5", name="ask", arguments='{"question": "go"}'), agent=lead)
    assert bad.refusal is not None and '"prompt"' in bad.refusal


def test_known_agents_are_the_ones_published_lately() -> None:
    r = fakeredis.FakeRedis()
    Agent(name="u_pub")
    assert publish_agents(r, now=1000.0) >= 1
    assert "u_pub" in [a["name"] for a in published_agent_details(r, now=1100.0)]
    assert published_agent_details(r, now=1000.0 + 601) == []
    publish_agents(r)
    require_known(r, "u_pub")
    require_known(r, None)
    with pytest.raises(UnknownAgent) as info:
        require_known(r, "nobody")
    assert info.value.agent == "nobody" and "u_pub" in info.value.known
    assert "known agents: " in info.value.message
    r.hset(k.AGENTS, "broken", "not json")
    assert "broken" not in [a["name"] for a in published_agent_details(r)]


def test_scripts_are_chosen_by_prompt_then_instructions_then_model() -> None:
    scripts = {"default": 0, "t-1": 0, "system:You are A": 0, "model:m-b": 0}
    assert script_key(scripts, "t-1 hi", "You are A.", "m-b") == "t-1"
    assert script_key(scripts, "free text", "You are A.", "m-b") == "system:You are A"
    assert script_key(scripts, "free text", "", "m-b") == "model:m-b"
    assert script_key(scripts, "free text", "You are C.", "m-c") == "default"
    assert script_key(scripts, "model:m-b", "", "x") == "default"


CALL = ToolCall(id="c1", name="ask")


def _stores() -> tuple[TurnStore, list[str]]:
    woken = Woken()
    store = TurnStore(fakeredis.FakeRedis(), stepper=woken)
    store.create("parent", {"status": "running"}, [])
    store.create("child", {"status": "running", "parent_turn_id": "parent"}, [])
    return store, woken


def test_a_childs_end_settles_the_parents_call_and_wakes_it_in_one_step() -> None:
    store, woken = _stores()
    store.record_dispatch("parent", {"c1": {"tool": "ask"}, "c2": {"tool": "echo"}})
    result = error_result(CALL, "child failed")
    assert store.close(
        "child", TurnStatus.ERROR, "turn_error", {"error": "x"}, settle_parent=("parent", result)
    )
    assert store.results("parent")["c1"].error == "child failed"
    finished = [e for e in store.bus.replay("parent") if e.type == "tool_finished"]
    assert [(e.fields["call_id"], e.fields["status"]) for e in finished] == [("c1", "error")]
    assert woken == []  # c2 is still running: its settle wakes the parent
    assert store.settle("parent", error_result(ToolCall(id="c2", name="echo"), "e"))
    assert woken == ["parent"]
    assert json.loads(store.redis.hget(k.turn_key("child"), "status")) == "error"


def test_a_childs_end_loses_to_a_result_already_there_and_to_an_ended_parent() -> None:
    store, woken = _stores()
    store.record_dispatch("parent", {"c1": {"tool": "ask"}})
    assert store.settle("parent", error_result(CALL, "timeout first"), wake=False)
    store.close(
        "child",
        TurnStatus.ABORTED,
        "turn_aborted",
        {},
        settle_parent=("parent", error_result(CALL, "late")),
    )
    assert store.results("parent")["c1"].error == "timeout first"
    assert woken == []
    store2, woken2 = _stores()
    store2.close("parent", TurnStatus.ABORTED, "turn_aborted", {})
    seq = store2.redis.hget(k.turn_key("parent"), "seq")
    store2.close(
        "child",
        TurnStatus.FINISHED,
        "turn_finished",
        {},
        settle_parent=("parent", error_result(CALL, "x")),
    )
    assert store2.results("parent") == {} and woken2 == []
    assert store2.redis.hget(k.turn_key("parent"), "seq") == seq  # nothing published after its end
