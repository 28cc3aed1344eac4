"""The scripted server's Responses API, checked against OpenAI's own clients: the `openai`
SDK's typed stream events validate every event it sends, and the OpenAI Agents SDK's
`OpenAIResponsesModel` runs a turn with a tool against it. Also its refusals: tools on
Chat Completions for a reasoning model, reasoning items resent out of order, and a 404
when it plays an older server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from agentq.models import Usage
from agentq.testing.openai_server import Round, ScriptedCall, ScriptedOpenAIServer
from agentq.testing.responses_answer import chat_tools_refusal
from agentq.testing.sse import parse_sse

pytestmark = pytest.mark.integration


def _event_models() -> dict[str, type[pydantic.BaseModel]]:
    """The SDK's model of each stream event type (its union, keyed by `type`)."""
    (union, *_) = typing.get_args(ResponseStreamEvent)
    models = {}
    for model in typing.get_args(union):
        (kind,) = typing.get_args(model.model_fields["type"].annotation)
        models[kind] = model
    return models


EVENTS = _event_models()
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    "strict": False,
}
SCRIPT = [
    Round(
        reasoning="The user wants a lookup.",
        text="Looking it up.",
        tool_calls=[ScriptedCall(name="lookup", arguments={"word": "agentq"})],
        chunk_size=5,
        usage=Usage(
            prompt_tokens=40,
            completion_tokens=30,
            total_tokens=70,
            cached_tokens=8,
            reasoning_tokens=12,
        ),
    ),
    Round(text="agentq is a queue of agents."),
]


@pytest.fixture
def server() -> Iterator[ScriptedOpenAIServer]:
    with ScriptedOpenAIServer({"look": SCRIPT}, refuse_chat_tools=True) as srv:
        yield srv


def _request(**extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5.5",
        "input": [{"role": "user", "content": "look agentq up"}],
        "tools": [TOOL],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "stream": True,
        **extra,
    }


def _events(server: ScriptedOpenAIServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}/responses", json=body, timeout=10) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(m.data) for m in parse_sse(resp.iter_lines()) if m.comment is None]


def test_every_event_validates_as_openai_types_them(server: ScriptedOpenAIServer) -> None:
    events = _events(server, _request())
    for event in events:
        EVENTS[event["type"]].model_validate(event, strict=False)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in (
        "response.reasoning_summary_text.delta",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds
    final = Response.model_validate(events[-1]["response"])
    reasoning, message, call = final.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert message.type == "message" and call.type == "function_call"
    assert json.loads(call.arguments) == {"word": "agentq"}
    assert final.usage is not None
    assert final.usage.input_tokens_details.cached_tokens == 8
    assert final.usage.output_tokens_details.reasoning_tokens == 12


def test_the_sdk_stream_yields_typed_events(server: ScriptedOpenAIServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="k", max_retries=0)
    with client.responses.create(
        model="gpt-5.5",
        input="look agentq up",
        tools=[TOOL],  # type: ignore[list-item]
        store=False,
        include=["reasoning.encrypted_content"],
        stream=True,
    ) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Looking it up."
    assert all(type(e).__module__.startswith("openai.types.responses") for e in events)
    assert events[-1].type == "response.completed"


def test_incomplete_and_failed_end_the_stream(server: ScriptedOpenAIServer) -> None:
    server.set_script("cut", [Round(text="a long answer", fault="incomplete")])
    server.set_script("fail", [Round(text="a long answer", fault="failed", fault_after_chunks=1)])
    for key, kind in (("cut", "response.incomplete"), ("fail", "response.failed")):
        events = _events(server, _request(input=key, tools=[]))
        for event in events:
            EVENTS[event["type"]].model_validate(event, strict=False)
        assert events[-1]["type"] == kind


def test_reasoning_resent_without_its_following_item_is_refused(
    server: ScriptedOpenAIServer,
) -> None:
    final = _events(server, _request())[-1]["response"]
    reasoning = final["output"][0]
    body = _request(input=[{"role": "user", "content": "look agentq up"}, reasoning])
    resp = httpx.post(f"{server.url}/responses", json=body, timeout=10)
    assert resp.status_code == 400
    assert "of type 'reasoning' was provided without its required following item" in resp.text
    forged = {**reasoning, "encrypted_content": "forged"}
    body = _request(input=[{"role": "user", "content": "look"}, forged, final["output"][1]])
    resp = httpx.post(f"{server.url}/responses", json=body, timeout=10)
    assert resp.status_code == 400 and "could not be verified" in resp.text
    # In order, the next round answers.
    following = [{"role": "user", "content": "look agentq up"}, *final["output"]]
    following.append({"type": "function_call_output", "call_id": "call_r0_0", "output": "ok"})
    events = _events(server, _request(input=following))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == SCRIPT[1].text


def test_a_reasoning_model_refuses_tools_on_chat_completions(
    server: ScriptedOpenAIServer,
) -> None:
    body = {
        "model": "gpt-5.5",
        "messages": [{"role": "user", "content": "look"}],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
    }
    resp = httpx.post(f"{server.url}/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == chat_tools_refusal("gpt-5.5")
    assert resp.json()["error"]["message"] == (
        "Function tools with reasoning_effort are not supported for gpt-5.5 in "
        "/v1/chat/completions. To use function tools, use /v1/responses or set "
        "reasoning_effort to 'none'."
    )
    del body["tools"]
    assert httpx.post(f"{server.url}/chat/completions", json=body, timeout=10).status_code == 200


def test_an_older_server_has_no_responses_route() -> None:
    with ScriptedOpenAIServer(responses_api=False) as srv:
        resp = httpx.post(f"{srv.url}/responses", json=_request(), timeout=10)
    assert resp.status_code == 404


AGENTS_RUN = """
import asyncio, json, sys
import agents, openai

looked_up = []

@agents.function_tool
def lookup(word: str) -> str:
    \"\"\"Look a word up.\"\"\"
    looked_up.append(word)
    return word + ": a queue of agents"

agents.set_tracing_disabled(True)
client = openai.AsyncOpenAI(base_url=sys.argv[1], api_key="k", max_retries=0)
model = agents.OpenAIResponsesModel(model="gpt-5.5", openai_client=client)
agent = agents.Agent(name="look", instructions="Look words up.", tools=[lookup], model=model)
result = asyncio.run(agents.Runner.run(agent, "look agentq up"))
print(json.dumps({"looked_up": looked_up, "final": result.final_output}))
"""


def test_the_agents_sdk_runs_a_turn_with_a_tool(server: ScriptedOpenAIServer) -> None:
    # In its own process: importing the Agents SDK here leaves CPython 3.11.7's AST
    # recursion counter off, and pytest's rewrite of a later import fails on it.
    if importlib.util.find_spec("agents") is None:
        pytest.skip("openai-agents is not installed (pip install openai-agents)")
    ran = subprocess.run(
        [sys.executable, "-c", AGENTS_RUN, server.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out == {"looked_up": ["agentq"], "final": SCRIPT[1].text}
    second = server.requests[-1]
    kinds = [i.get("type", "message") for i in second["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds
