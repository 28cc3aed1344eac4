"""The @tool decorator: schema from the signature, validation, bad declarations."""

from __future__ import annotations

import pytest

from agentq import ToolContext, tool
from agentq.errors import ToolArgumentsInvalid, ToolDefinitionError, UnknownTool
from agentq.tools.registry import get_tool, parse_arguments, unregister


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
        ({"no_such_knob": 1}, "no_such_knob"),
    ],
)
def test_bad_policy_is_a_definition_error(policy: dict[str, object], match: str) -> None:
    with pytest.raises(ToolDefinitionError, match=match):
        tool(**policy)(lambda: None)  # type: ignore[arg-type]


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
