"""Every path of a turn on both model APIs, through real turn, stream and tool workers and
the scripted server: tool calls, an abort mid-stream, the inactivity watchdog (a stall
before any output, a stall mid-stream, keep-alive comments only), budgets and spend,
sub-agents and typed answers. Each case runs on `chat`, on `responses`, and on `auto`
against a server that plays a reasoning model refusing tools on chat completions (no
setting changed: the model moves to the Responses API at its first round)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentq.events import Event
from agentq.gateway import create_app
from agentq.llm.apis import read_learned
from agentq.llm.client import REASONING_ITEMS
from agentq.local.processes import wait_for
from agentq.models import Usage
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, first_user_text
from agentq.testing.responses_answer import chat_tools_refusal, input_messages
from tests.conftest import BASE_TOOLS
from tests.faults.rig import Rig
from tests.helpers import assert_valid_history, calls

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

IDLE_MS = 2000
PRICES = {"gpt-4o-mini": {"input": 1.0, "output": 4.0, "cached_input": 0.5}}


@pytest.fixture(scope="module", params=["chat", "responses", "auto"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    env = {
        "AGENTQ_TOOLS": BASE_TOOLS,  # its budget is sized by the first round's prompt
        "AGENTQ_STREAM_IDLE_TIMEOUT_MS": str(IDLE_MS),
        "AGENTQ_LLM_MAX_RETRIES": "1",
        "AGENTQ_LLM_PRICES": json.dumps(PRICES),
        "AGENTQ_BUDGET_COMPLETION_TOKENS": "64",
    }
    if request.param != "auto":
        env["AGENTQ_LLM_API"] = request.param
    made = Rig(f"apis-{request.param}", **env)
    made.api = request.param  # type: ignore[attr-defined]
    try:
        # Under auto the server is a reasoning model: tools on chat completions get its 400.
        made.llm.refuse_chat_tools = request.param == "auto"
        made.start("tools", "llm", "turns")
        yield made
    finally:
        made.close()


def sent(rig: Rig, key: str) -> list[dict[str, Any]]:
    """The requests the server received for a script key, in order."""
    out = []
    for body in list(rig.llm.requests):
        messages = body["messages"] if "messages" in body else input_messages(body)
        if first_user_text(messages).startswith(key):
            out.append(body)
    return out


def api_of(body: dict[str, Any]) -> str:
    return "responses" if "input" in body else "chat"


def check_apis(rig: Rig, key: str) -> list[dict[str, Any]]:
    """The requests of a script key went to the rig's API: under auto, the first model's
    first round was refused on chat and sent again on the Responses API, and none after
    it went to chat."""
    bodies = sent(rig, key)
    apis = [api_of(b) for b in bodies]
    if rig.api == "chat":  # type: ignore[attr-defined]
        assert set(apis) == {"chat"}, apis
    elif rig.api == "responses":  # type: ignore[attr-defined]
        assert set(apis) == {"responses"}, apis
    else:
        assert "responses" in apis and "chat" not in apis[apis.index("responses") :], apis
    return [b for b in bodies if api_of(b) == "responses"]


def test_a_turn_with_tool_calls_resends_its_reasoning(rig: Rig) -> None:
    key = rig.script(
        Round(
            reasoning="Echo twice.",
            text="Working.",
            tool_calls=calls(("echo", {"text": "hi"}), ("echo", {"text": "again"})),
        ),
        Round(reasoning="Once more.", tool_calls=calls(("echo", {"text": "3"}))),
        Round(text="All done."),
    )
    events = rig.collect(rig.client._start_turn(f"{key} go").turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == "All done."
    reasoning = "".join(
        e.fields["text"]
        for e in events
        if e.type == "llm_delta" and e.fields["kind"] == "reasoning"
    )
    assert reasoning == "Echo twice.Once more."
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["ok", "ok", "ok"]
    view = rig.client.get(events[0].turn_id)
    history = view["history"]
    assert [m["role"] for m in history] == [
        "user", "assistant", "tool", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert_valid_history(history)
    follow_ups = check_apis(rig, key)
    if rig.api == "chat":  # type: ignore[attr-defined]
        assert all(REASONING_ITEMS not in m for m in history)
        return
    # Every follow-up round resends every reasoning item so far, each right before the
    # item that followed it; clients see the summaries, never the sealed content.
    assert [len(_reasoning(b)) for b in follow_ups] == [0, 1, 2]
    for body in follow_ups:
        items = body["input"]
        for at, item in enumerate(items):
            if item.get("type") == "reasoning":
                assert item["encrypted_content"]
                assert items[at + 1].get("type") in ("function_call", None)
    shown = [m[REASONING_ITEMS] for m in history if REASONING_ITEMS in m]
    assert len(shown) == 2
    assert all("encrypted_content" not in item for items in shown for item in items)
    assert follow_ups[0]["store"] is False
    assert follow_ups[0]["include"] == ["reasoning.encrypted_content"]


def _reasoning(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in body["input"] if i.get("type") == "reasoning"]


def test_abort_mid_stream_ends_the_turn_and_its_stream(rig: Rig) -> None:
    key = rig.script(Round(text="slow words " * 20, chunk_size=3, chunk_delay_ms=100))
    handle = rig.client._start_turn(key)
    rig.collect(handle.turn_id, until=lambda e: e.type == "llm_delta")
    rig.client.abort(handle.turn_id, handle.token)
    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_aborted", events[-1]
    wait_for(lambda: rig.llm.open_streams == 0, 10, message="the model stream to close")


def _llm_codes(events: list[Event]) -> list[str]:
    return [str(e.fields.get("code")) for e in events if e.type in ("llm_retry", "llm_finished")]


def test_a_stall_before_any_output_is_retried(rig: Rig) -> None:
    key = rig.script(Round(text="late but fine", fault="silent_after_200", fault_times=1))
    events = rig.collect(rig.client._start_turn(key).turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == "late but fine"
    assert "ETIMEDOUT" in _llm_codes(events)


@pytest.mark.parametrize("fault", ["silent_after_chunks", "keepalive_only"])
def test_silence_mid_stream_is_an_idle_timeout(rig: Rig, fault: str) -> None:
    # Keep-alive comments are no activity: only a parsed chunk or event is.
    key = rig.script(Round(text="hello world", chunk_size=5, fault=fault, fault_after_chunks=2))
    events = rig.collect(rig.client._start_turn(key).turn_id, timeout_s=60)
    assert events[-1].type == "turn_error", events[-1]
    assert events[-1].fields["code"] == "ETIMEDOUT"
    deltas = "".join(e.fields["text"] for e in events if e.type == "llm_delta")
    assert deltas.startswith("hello worl")


def test_usage_reaches_spend_and_a_budget_holds(rig: Rig) -> None:
    used = Usage(
        prompt_tokens=1000,
        completion_tokens=100,
        total_tokens=1100,
        cached_tokens=400,
        reasoning_tokens=60,
    )
    key = rig.script(
        Round(reasoning="r", tool_calls=calls(("echo", {"text": "x"})), usage=used),
        Round(text="done", usage=used),
    )
    events = rig.collect(rig.client._start_turn(f"{key} go").turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    usages = [e.fields["usage"] for e in events if e.type == "llm_finished"]
    assert [u["prompt_tokens"] for u in usages] == [1000, 1000]
    assert {u["cached_tokens"] for u in usages} == {400}
    assert {u["reasoning_tokens"] for u in usages} == {60}
    cost = (600 * 1.0 + 400 * 0.5 + 100 * 4.0) / 1e6
    spend = rig.client.get(events[0].turn_id)["spend"]
    assert spend["total_tokens"] == 2200 and spend["cached_tokens"] == 800
    assert spend["cost_usd"] == pytest.approx(2 * cost)
    check_apis(rig, key)

    loop = [Round(tool_calls=calls(("echo", {"text": f"r{i}"}))) for i in range(30)]
    key = rig.script(*loop, Round(text="never"))
    handle = rig.client._start_turn(f"{key} go", max_tokens=2000)
    events = rig.collect(handle.turn_id, timeout_s=60)
    assert events[-1].type == "turn_error" and events[-1].fields["code"] == "budget_exceeded"
    view = rig.client.get(handle.turn_id)
    assert view["spend"]["total_tokens"] <= 2000
    assert_valid_history(view["history"])
    bounded = check_apis(rig, key) if rig.api != "chat" else sent(rig, key)  # type: ignore[attr-defined]
    cap = "max_output_tokens" if rig.api != "chat" else "max_completion_tokens"  # type: ignore[attr-defined]
    assert all(0 < b[cap] <= 64 for b in bounded)


def test_a_sub_agent_and_a_typed_answer(rig: Rig) -> None:
    child_key = rig.script(
        Round(reasoning="child thinks", tool_calls=calls(("echo", {"text": "from child"}))),
        Round(text="42"),
    )
    key = rig.script(
        Round(tool_calls=calls(("ask_echoer", {"prompt": f"{child_key} what is it?"}))),
        Round(text="The echoer said 42."),
    )
    parent = rig.client._start_turn(key, agent="t_boss")
    events = [e for e in rig.collect(parent.turn_id) if not e.path]
    assert events[-1].type == "turn_finished", events[-1]
    history = rig.client.get(parent.turn_id)["history"]
    assert [m["content"] for m in history if m["role"] == "tool"] == ["42"]
    check_apis(rig, child_key)

    key = rig.script(Round(text='{"answer": "yes", "confidence": 0.9}'))
    judged = rig.client._start_turn(key, agent="t_judge")
    assert rig.collect(judged.turn_id)[-1].type == "turn_finished"
    for body in check_apis(rig, key):
        assert body["text"]["format"]["type"] == "json_schema"
        assert body["text"]["format"]["name"] == "Verdict"


def test_a_conversation_resends_its_reasoning_in_its_next_turn(rig: Rig) -> None:
    key = rig.script(Round(reasoning="first thought", text="first answer"), Round(text="second"))
    conv = f"c-{uuid.uuid4().hex[:12]}"
    first = rig.client._start_turn(f"{key} one", conversation_id=conv, operator=True)
    assert rig.collect(first.turn_id)[-1].type == "turn_finished"
    second = rig.client._start_turn("two", conversation_id=conv, operator=True)
    events = rig.collect(second.turn_id)
    assert events[-1].type == "turn_finished" and events[-1].fields["content"] == "second"
    messages = rig.client.conversation(conv, operator=True)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    last = sent(rig, key)[-1]
    if rig.api == "chat":  # type: ignore[attr-defined]
        assert all(REASONING_ITEMS not in m for m in messages)
        return
    (item,) = _reasoning(last)
    at = last["input"].index(item)
    assert last["input"][at + 1] == {"role": "assistant", "content": "first answer"}
    (shown,) = messages[1][REASONING_ITEMS]
    assert shown["summary"][0]["text"] == "first thought" and "encrypted_content" not in shown


def test_auto_switched_fleet_wide_once_and_says_so(rig: Rig) -> None:
    if rig.api != "auto":  # type: ignore[attr-defined]
        pytest.skip("the switch is auto's")
    key = rig.script(Round(text="hello"))
    rig.collect(rig.client._start_turn(key).turn_id)
    learned = read_learned(rig.client._store.redis)
    assert learned["gpt-4o-mini"]["api"] == "responses"
    assert learned["gpt-4o-mini"]["reason"].endswith(chat_tools_refusal("gpt-4o-mini"))
    logs = rig.logs()
    assert logs.count("model gpt-4o-mini moves to the Responses API fleet-wide") == 1
    with BackgroundServer(create_app(rig.client)) as gateway:
        body = httpx.get(f"{gateway.url}/v1/capacity", timeout=10).json()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    shown = next(m for m in body["models"] if m["model"] == "gpt-4o-mini")["api"]
    assert shown["setting"] == "auto" and shown["in_use"] == "responses"
    assert "/v1/responses" in shown["learned"]["reason"]
    line = 'agentq_llm_api{api="responses",model="gpt-4o-mini",setting="auto"} 1.0'
    assert line in metrics
