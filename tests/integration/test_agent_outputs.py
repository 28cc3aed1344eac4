"""Typed final outputs through real workers: validated, sent back once, stored, relayed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentq.api import Client
from agentq.testing.openai_server import Round, first_user_text
from tests.agents_under_test import Verdict
from tests.helpers import calls, collect, script

pytestmark = pytest.mark.integration


def requests_for(llm_server: Any, key: str) -> list[dict[str, Any]]:
    return [r for r in llm_server.requests if first_user_text(r["messages"]).startswith(key)]


def own(events: list[Any]) -> list[Any]:
    return [e for e in events if not e.path]


def test_a_valid_answer_is_stored_typed_and_returned(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(text='{"answer": "yes", "confidence": 0.9}'))
    handle = client._start_turn(key, agent="t_judge")
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["output"] == {"answer": "yes", "confidence": 0.9}
    assert client.get(handle.turn_id)["state"]["output"] == {"answer": "yes", "confidence": 0.9}
    (sent,) = requests_for(llm_server, key)
    # The model is told the schema after the agent's instructions.
    system = sent["messages"][0]["content"]
    assert system.startswith("You are t_judge.") and '"confidence"' in system


def test_an_invalid_answer_goes_back_once_with_the_error(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(text='{"answer": "maybe", "confidence": 7}'),
        Round(text='```json\n{"answer": "no", "confidence": 0.25}\n```'),
    )
    handle = client._start_turn(key, agent="t_judge")
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    output = client.get(handle.turn_id)["state"]["output"]
    assert Verdict.model_validate(output) == Verdict(answer="no", confidence=0.25)
    _, second = requests_for(llm_server, key)
    correction = second["messages"][-1]
    assert correction["role"] == "user"
    assert "not a valid Verdict" in correction["content"]
    assert "confidence" in correction["content"]
    assert second["messages"][-2]["content"] == '{"answer": "maybe", "confidence": 7}'


def test_a_second_invalid_answer_fails_the_turn(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(text="I think yes."), Round(text='{"answer": "yes"}'))
    handle = client._start_turn(key, agent="t_judge")
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_error", events[-1]
    assert events[-1].fields["code"] == "invalid_output"
    assert "confidence" in events[-1].fields["error"]
    assert len(requests_for(llm_server, key)) == 2
    assert client.get(handle.turn_id)["state"].get("output") is None


def test_a_parent_gets_the_typed_value_as_the_calls_result(
    fleet, llm_server, client: Client
) -> None:
    child_key = script(llm_server, Round(text=' {"confidence": 1, "answer": "42"} '))
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_judge", {"prompt": f"{child_key} judge"}))),
        Round(text="done"),
    )
    parent = client._start_turn(key, agent="t_boss")
    events = own(collect(client, parent.turn_id))
    assert events[-1].type == "turn_finished", events[-1]
    (finished,) = [e for e in events if e.type == "tool_finished"]
    assert finished.fields["status"] == "ok"
    tool_msgs = [m for m in client.get(parent.turn_id)["history"] if m["role"] == "tool"]
    assert [json.loads(m["content"]) for m in tool_msgs] == [{"answer": "42", "confidence": 1.0}]
    # A turn of an agent without an output type has none.
    assert client.get(parent.turn_id)["state"].get("output") is None
