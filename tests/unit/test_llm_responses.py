"""The Responses API's request building and event reading (agentq.llm.responses), the
reasoning items in history (agentq.llm.responses), and which API a model uses
(agentq.llm.apis)."""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import pytest

from agentq.config import Settings
from agentq.errors import (
    MalformedStreamChunk,
    ModelHTTPError,
    ModelIncomplete,
    ModelResponseFailed,
)
from agentq.llm.apis import ApiChoice, api_view, configured, names_responses, read_learned
from agentq.llm.client import REASONING_ITEMS, without_reasoning
from agentq.llm.limits import parse_limits
from agentq.llm.responses import (
    UNKNOWN_EVENTS,
    ResponsesAssembler,
    output_format,
    public_history,
    responses_request,
)
from agentq.models import AssistantMessage, ToolCall
from agentq.orchestrator.plan import history_form
from agentq.testing.responses_answer import chat_tools_refusal

REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAx"}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "echo", "description": "Echo.", "parameters": {"type": "object"}},
    }
]


def _history() -> list[dict[str, Any]]:
    first = AssistantMessage(
        content="Checking.",
        tool_calls=(ToolCall(id="call_1", name="echo", arguments='{"text":"hi"}'),),
        reasoning_items=(REASONING,),
    )
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "say hi"},
        history_form(first, 10_000)[0],
        {"role": "tool", "tool_call_id": "call_1", "content": "hi"},
    ]


def test_the_request_is_stateless_and_resends_reasoning_before_its_item() -> None:
    body = json.loads(responses_request("gpt-5.5", _history(), json.dumps(TOOLS), 100))
    assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    assert "previous_response_id" not in body and body["stream"] is True
    assert body["instructions"] == "Be brief." and body["max_output_tokens"] == 100
    assert body["input"] == [
        {"role": "user", "content": "say hi"},
        REASONING,
        {"role": "assistant", "content": "Checking."},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "echo",
            "arguments": '{"text":"hi"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "hi"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "name": "echo",
            "description": "Echo.",
            "parameters": {"type": "object"},
            "strict": False,
        }
    ]


def test_a_typed_answer_asks_for_its_json_schema() -> None:
    fmt = output_format("Weather Report", {"type": "object"})
    body = json.loads(responses_request("m", [{"role": "user", "content": "x"}], "[]", None, fmt))
    assert body["text"] == {
        "format": {
            "type": "json_schema",
            "name": "Weather_Report",
            "schema": {"type": "object"},
            "strict": False,
        }
    }
    assert "tools" not in body and "instructions" not in body


def test_chat_never_sees_reasoning_and_clients_never_see_its_sealed_content() -> None:
    history = _history()
    assert all(REASONING_ITEMS not in m for m in without_reasoning(history))
    assert without_reasoning(history[:2]) is not None
    shown = public_history(history)
    assert shown[2][REASONING_ITEMS] == [{"type": "reasoning", "id": "rs_1", "summary": []}]
    assert history[2][REASONING_ITEMS][0]["encrypted_content"] == "gAAAAx"


def _play(events: list[dict[str, Any]]) -> tuple[AssistantMessage, list[tuple[str, str]]]:
    deltas: list[tuple[str, str]] = []
    assembler = ResponsesAssembler(lambda kind, text: deltas.append((kind, text)))
    for index, event in enumerate(events):
        assembler.add(event, index)
    return assembler.message(len(events) - 1), deltas


COMPLETED = {
    "type": "response.completed",
    "response": {
        "usage": {
            "input_tokens": 50,
            "input_tokens_details": {"cached_tokens": 10},
            "output_tokens": 30,
            "output_tokens_details": {"reasoning_tokens": 20},
            "total_tokens": 80,
        }
    },
}


def test_events_make_the_assistant_message() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "echo"}
    events = [
        {"type": "response.created", "response": {}},
        {"type": "response.output_item.added", "output_index": 0, "item": REASONING},
        {"type": "response.reasoning_summary_text.delta", "output_index": 0, "delta": "think"},
        {"type": "response.output_item.done", "output_index": 0, "item": REASONING},
        {"type": "response.output_text.delta", "output_index": 1, "delta": "Hel"},
        {"type": "response.output_text.delta", "output_index": 1, "delta": "lo"},
        {
            "type": "response.output_item.added",
            "output_index": 2,
            "item": {**call, "arguments": ""},
        },
        {"type": "response.function_call_arguments.delta", "output_index": 2, "delta": '{"te'},
        {"type": "response.function_call_arguments.delta", "output_index": 2, "delta": 'xt":1}'},
        {
            "type": "response.function_call_arguments.done",
            "output_index": 2,
            "arguments": '{"text":1}',
        },
        {
            "type": "response.output_item.done",
            "output_index": 2,
            "item": {**call, "arguments": '{"text":1}'},
        },
        COMPLETED,
    ]
    message, deltas = _play(events)
    assert deltas == [("reasoning", "think"), ("text", "Hel"), ("text", "lo")]
    assert message.content == "Hello" and message.reasoning == "think"
    assert message.tool_calls == (ToolCall(id="call_9", name="echo", arguments='{"text":1}'),)
    assert message.finish_reason == "tool_calls" and message.reasoning_items == (REASONING,)
    assert message.usage is not None
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (50, 30)
    assert (message.usage.cached_tokens, message.usage.reasoning_tokens) == (10, 20)


def test_unknown_events_are_ignored_and_counted() -> None:
    before = UNKNOWN_EVENTS["response.something_new"]
    message, _ = _play([{"type": "response.something_new", "x": 1}, COMPLETED])
    assert message.content == "" and UNKNOWN_EVENTS["response.something_new"] == before + 1


INCOMPLETE = {"incomplete_details": {"reason": "max_output_tokens"}}
FAILED = {"error": {"code": "server_error", "message": "boom"}}
ARGS = "response.function_call_arguments.delta"


@pytest.mark.parametrize(
    ("event", "error"),
    [
        ({"type": "response.incomplete", "response": INCOMPLETE}, ModelIncomplete),
        ({"type": "response.failed", "response": FAILED}, ModelResponseFailed),
        ({"type": "error", "code": "invalid_prompt", "message": "no"}, ModelResponseFailed),
        ({"no": "type"}, MalformedStreamChunk),
        (
            {"type": "response.output_text.delta", "output_index": 0, "delta": 5},
            MalformedStreamChunk,
        ),
        ({"type": ARGS, "output_index": 3, "delta": "x"}, MalformedStreamChunk),
        ({"type": "response.completed", "response": "x"}, MalformedStreamChunk),
    ],
)
def test_failures_are_typed(event: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        _play([event])


def test_a_failure_is_retried_as_a_server_error_is() -> None:
    assert ModelResponseFailed("server_error", "x").retryable
    assert not ModelResponseFailed("invalid_prompt", "x").retryable
    assert ModelIncomplete("max_output_tokens").code == "EINCOMPLETE"


def test_a_stream_that_ends_without_completed_is_malformed() -> None:
    with pytest.raises(MalformedStreamChunk, match=r"without response\.completed"):
        _play([{"type": "response.output_text.delta", "output_index": 0, "delta": "x"}])


def test_the_refusal_that_names_responses_is_recognised() -> None:
    assert names_responses(ModelHTTPError(400, chat_tools_refusal("gpt-5.5"), False))
    assert not names_responses(ModelHTTPError(400, "bad request", False))
    assert not names_responses(ModelHTTPError(404, "no /v1/responses here", False))


def test_auto_learns_fleet_wide_and_the_configuration_wins() -> None:
    client = fakeredis.FakeRedis()
    settings = Settings(llm_api="auto")
    limits = parse_limits('{"pinned": {"api": "chat"}, "new": {"api": "responses"}}')
    assert configured("pinned", settings, limits) == "chat"
    assert configured("new", settings, limits) == "responses"
    assert configured("other", settings, limits) == "auto"
    one, two = ApiChoice(client), ApiChoice(client)
    assert one.api_for("other", "auto") == "chat"
    assert one.learn("other", "responses", "400: use /v1/responses")
    assert not one.learn("other", "responses", "again")
    assert two.api_for("other", "auto") == "chat" and two.stale()
    two.refresh()
    assert two.api_for("other", "auto") == "responses" and not two.stale()
    assert two.api_for("other", "chat") == "chat"
    view = api_view("other", settings, limits, read_learned(client))
    assert view["setting"] == "auto" and view["in_use"] == "responses"
    assert view["learned"]["reason"] == "again"
    assert api_view("pinned", settings, limits, {})["in_use"] == "chat"
    one.learn("old", "chat", "/v1/responses answered 404")
    assert one.kept_on_chat("old") and not one.kept_on_chat("other")
