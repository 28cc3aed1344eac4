"""Settling rules, batching, the loop detector and the call limit, without waiting."""

from __future__ import annotations

import json

from agentq import tool
from agentq.models import ToolCall, ToolResultMessage
from agentq.orchestrator.plan import batches, limit_checks, pending_calls, plan_call
from agentq.tools.registry import unregister
from agentq.tools.results import (
    cancelled_result,
    denied_result,
    error_result,
    lost_result,
    timeout_result,
)


def c(i: int, name: str = "t", args: str = "{}") -> ToolCall:
    return ToolCall(id=f"c{i}", name=name, arguments=args)


def test_denied_result_has_the_typed_shape() -> None:
    r = denied_result(c(1), "timeout")
    assert json.loads(r.content) == {
        "status": "denied",
        "decider": "mode_gate",
        "reason": "timeout",
    }
    assert r.status == "denied" and r.record.status == "denied"


def test_timeout_result_says_what_happened_and_what_to_try() -> None:
    killed = json.loads(timeout_result(c(1, "build"), 120, killed=True).content)
    assert "120s" in killed["error"] and "killed" in killed["error"]
    assert "_meta" in killed["advice"]
    running = json.loads(timeout_result(c(1), 5, killed=False).content)
    assert "may still be running" in running["error"]


def test_every_status_has_a_constructor() -> None:
    statuses = {
        error_result(c(1), "x").status,
        timeout_result(c(1), 1, killed=True).status,
        cancelled_result(c(1)).status,
        denied_result(c(1), "user").status,
        lost_result(c(1), "gone").status,
    }
    assert statuses == {"error", "timeout", "cancelled", "denied", "lost"}


def test_tool_result_message_renders_openai() -> None:
    msg = ToolResultMessage(results=[error_result(c(1), "bad"), denied_result(c(2), "user")])
    assert [m["tool_call_id"] for m in msg.to_openai()] == ["c1", "c2"]
    assert all(m["role"] == "tool" for m in msg.to_openai())


def test_exclusive_calls_get_a_batch_of_their_own() -> None:
    @tool(concurrency="exclusive")
    def ex_tool() -> None: ...

    @tool
    def par_tool() -> None: ...

    try:
        names = ["par_tool", "par_tool", "ex_tool", "par_tool", "ex_tool", "ex_tool"]
        plans = [plan_call(c(i, n)) for i, n in enumerate(names)]
        assert all(p.refusal is None for p in plans)
        assert [[p.call.id for p in b] for b in batches(plans)] == [
            ["c0", "c1"],
            ["c2"],
            ["c3"],
            ["c4"],
            ["c5"],
        ]
    finally:
        unregister("ex_tool")
        unregister("par_tool")


def test_call_limit_refuses_the_excess_and_stops_the_turn() -> None:
    earlier = [c(i, "t", f'{{"i": {i}}}') for i in range(3)]
    new = [c(10 + i, "t", f'{{"i": {10 + i}}}') for i in range(3)]
    refused, stop = limit_checks(earlier, new, max_calls=4, loop_threshold=3)
    assert set(refused) == {"c11", "c12"} and stop == "max_calls_per_turn"
    assert "max_calls_per_turn=4" in refused["c11"]


def test_loop_detector_counts_same_tool_and_arguments() -> None:
    earlier = [c(1, "t", '{"a": 1, "b": 2}'), c(2, "t", '{"b": 2, "a": 1}')]
    refused, stop = limit_checks(
        earlier, [c(3, "t", '{"a":1,"b":2}'), c(4, "t", '{"a": 9}')], max_calls=50, loop_threshold=3
    )
    assert list(refused) == ["c3"] and stop == "loop_detected"


def test_pending_calls_are_the_unanswered_calls_of_the_last_assistant_message() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "t", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "t", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "x"},
    ]
    assert [p.id for p in pending_calls(history)] == ["b"]
    history.append({"role": "tool", "tool_call_id": "b", "content": "y"})
    assert pending_calls(history) == []
    assert pending_calls([{"role": "user", "content": "x"}]) == []


def test_oversized_arguments_do_not_stay_in_history() -> None:
    from agentq.models import AssistantMessage
    from agentq.orchestrator.plan import history_form

    msg = AssistantMessage(tool_calls=(c(1, "t", json.dumps({"x": "y" * 5000})), c(2, "t")))
    out, refused = history_form(msg, 1000)
    assert list(refused) == ["c1"] and "over the limit of 1000 bytes" in refused["c1"]
    args = [json.loads(tc["function"]["arguments"]) for tc in out["tool_calls"]]
    assert "_removed_by_agentq" in args[0] and "5009 bytes" in args[0]["_removed_by_agentq"]
    assert args[1] == {}
