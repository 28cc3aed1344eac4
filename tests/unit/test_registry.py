"""The @tool decorator: schema from the signature, validation, bad declarations."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from agentq import ToolContext, tool
from agentq.errors import ToolArgumentsInvalid, ToolDefinitionError, UnknownTool
from agentq.llm.client import chat_request
from agentq.models import LlmRoundRequest
from agentq.tools.registry import get_tool, parse_arguments, schemas_json, unregister


def test_schema_from_signature_and_docstring() -> None:
    @tool(timeout_s=30, budget_s=5)
    def search_docs(ctx: ToolContext, query: str, limit: int = 5) -> list[str]:
        """Search the docs."""
        return []

    try:
        spec = get_tool("search_docs")
        assert spec.wants_ctx
        assert spec.description == "Search the docs."
        fn = spec.openai_schema()["function"]
        assert fn["name"] == "search_docs"
        params = fn["parameters"]
        assert params["properties"] == {
            "query": {"type": "string"},
            "limit": {"type": "integer", "default": 5},
        }
        assert params["required"] == ["query"]
        assert params["additionalProperties"] is False
        assert spec.policy.timeout_s == 30 and spec.task_name == "agentq.tool.search_docs"
        assert spec.validate({"query": "x", "limit": "3"}).limit == 3  # type: ignore[attr-defined]
        with pytest.raises(ToolArgumentsInvalid, match="limit"):
            spec.validate({"query": "x", "limit": "many"})
        with pytest.raises(ToolArgumentsInvalid, match="query"):
            spec.validate({})
    finally:
        unregister("search_docs")


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ({"timeout_s": 10, "soft_timeout_s": 12}, "soft_timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"concurrency": "sometimes"}, "concurrency"),
        ({"approval": "ask", "approval_kind": "device_code"}, "finite"),
    ],
)
def test_bad_policy_is_a_definition_error(policy: dict[str, object], match: str) -> None:
    with pytest.raises(ToolDefinitionError, match=match):
        tool(**policy)(lambda: None)  # type: ignore[arg-type]


def test_an_unknown_policy_knob_is_refused_by_the_signature() -> None:
    # mypy refuses it too: the policy is typed keyword parameters, not **kwargs.
    with pytest.raises(TypeError, match="timeout"):
        tool(timeout=5)  # type: ignore[call-overload]


def test_varargs_cannot_be_described() -> None:
    def f(*items: int) -> None: ...

    with pytest.raises(ToolDefinitionError, match="items"):
        tool(f)


def test_unknown_tool_lists_the_known_ones() -> None:
    @tool
    def known_one() -> str:
        return "x"

    try:
        with pytest.raises(UnknownTool, match="known_one"):
            get_tool("nope")
    finally:
        unregister("known_one")


def test_parse_arguments_errors_are_specific() -> None:
    assert parse_arguments("t", "") == {}
    with pytest.raises(ToolArgumentsInvalid, match="not valid JSON"):
        parse_arguments("t", "{oops")
    with pytest.raises(ToolArgumentsInvalid, match="JSON object, got list"):
        parse_arguments("t", "[1]")


def test_async_tools_route_to_the_io_queue_and_sync_ones_to_tools() -> None:
    @tool
    async def fetch_async(url: str) -> str:
        return url

    @tool(thread=True)
    def blocking_lib(url: str) -> str:
        return url

    @tool(queue="special")
    async def routed(url: str) -> str:
        return url

    try:
        assert get_tool("fetch_async").kind == "async"
        assert get_tool("fetch_async").policy.queue == "agentq.io"
        assert get_tool("blocking_lib").kind == "thread"
        assert get_tool("blocking_lib").policy.queue == "agentq.io"
        assert get_tool("routed").policy.queue == "special"
    finally:
        for n in ("fetch_async", "blocking_lib", "routed"):
            unregister(n)


def test_generators_and_async_generators_are_refused_at_declaration() -> None:
    def gen() -> object:
        yield 1

    async def agen() -> object:
        yield 1

    async def coro() -> None: ...

    with pytest.raises(ToolDefinitionError, match=r"generator cannot be a tool.*return a list"):
        tool(gen)
    with pytest.raises(ToolDefinitionError, match="async generator cannot be a tool"):
        tool(agen)
    with pytest.raises(ToolDefinitionError, match="thread=True is for sync tools"):
        tool(thread=True)(coro)


def test_unset_policy_fields_take_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentq.fleet import runtime

    @tool
    def plain() -> str:
        return "x"

    @tool(timeout_s=0, budget_s=3)
    def unlimited() -> str:
        return "x"

    monkeypatch.setenv("AGENTQ_TOOL_TIMEOUT_S", "45")
    monkeypatch.setenv("AGENTQ_TOOL_BUDGET_S", "7")
    runtime.reset()
    try:
        pol = get_tool("plain").policy
        assert (pol.timeout_s, pol.budget_s, pol.queue) == (45, 7, "agentq.tools")
        pol = get_tool("unlimited").policy
        assert (pol.timeout_s, pol.budget_s) == (0, 3)  # 0: no limit, kept as declared
    finally:
        unregister("plain")
        unregister("unlimited")
        monkeypatch.delenv("AGENTQ_TOOL_TIMEOUT_S")
        monkeypatch.delenv("AGENTQ_TOOL_BUDGET_S")
        runtime.reset()


def test_a_rounds_tool_schemas_are_encoded_once_per_tool_set_and_sent_unparsed() -> None:
    @tool(name="t_schema_a")
    def a(text: str) -> str:
        return text

    @tool(name="t_schema_b")
    def b(n: int = 1) -> int:
        return n

    try:
        both = [get_tool("t_schema_a"), get_tool("t_schema_b")]
        text = schemas_json(both)
        assert schemas_json(list(both)) is text  # the same tools: the text encoded before
        assert [s["function"]["name"] for s in json.loads(text)] == ["t_schema_a", "t_schema_b"]
        assert json.loads(schemas_json(both[:1])) == [both[0].openai_schema()]

        body = json.loads(chat_request("m", [{"role": "user", "content": "hi"}], text))
        assert body["tools"] == json.loads(text) and body["stream"] is True
        assert "tools" not in json.loads(chat_request("m", [], "[]"))

        with pytest.raises(ValidationError, match="should match pattern"):
            LlmRoundRequest(
                turn_id="t", round_no=0, tools_json='{"x": 1}', duration_left_s=1, idle_timeout_ms=1
            )
    finally:
        unregister("t_schema_a")
        unregister("t_schema_b")


def test_a_round_request_from_an_older_turn_worker_is_taken() -> None:
    # During a rolling deploy an older turn worker may still send a field this version
    # dropped; the round must run, not fail validation on the newer stream worker.
    req = LlmRoundRequest.model_validate(
        {
            "turn_id": "t",
            "round_no": 1,
            "duration_left_s": 1,
            "idle_timeout_ms": 1,
            "tokens_estimate": 7,
        }
    )
    assert req.round_no == 1 and not hasattr(req, "tokens_estimate")
