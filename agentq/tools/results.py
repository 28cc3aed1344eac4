"""Settling rules: how each way a call can end becomes one ToolResult the model can act on."""

from __future__ import annotations

import json
import time
from typing import Any

from agentq.models import InvocationRecord, ToolCall, ToolResult, ToolStatus


def _result(
    call: ToolCall, status: ToolStatus, shown: dict[str, Any], record: dict[str, Any], **fields: Any
) -> ToolResult:
    """A result of `status`: the model reads `shown` unless `fields` give a content; `record`
    holds its InvocationRecord's fields."""
    finished = record.pop("finished_at", None) or time.time()
    started = record.get("started_at")
    duration_ms = int((finished - started) * 1000) if started is not None else None
    ids: dict[str, Any] = {"call_id": call.id, "tool": call.name, "status": status}
    return ToolResult(
        **ids,
        record=InvocationRecord(**ids, finished_at=finished, duration_ms=duration_ms, **record),
        **{"content": json.dumps({"status": status, **shown}), **fields},
    )


def ok_result(call: ToolCall, content: str, truncated_bytes: int = 0, **record: Any) -> ToolResult:
    return _result(call, "ok", {}, record, content=content, truncated_bytes=truncated_bytes)


def error_result(call: ToolCall, message: str, **record: Any) -> ToolResult:
    return _result(call, "error", {"error": message}, record, error=message)


def timeout_result(
    call: ToolCall,
    timeout_s: float,
    *,
    killed: bool,
    soft: bool = False,
    what: str | None = None,
    **record: Any,
) -> ToolResult:
    """`what` replaces the standard explanation (e.g. for a cancelled coroutine)."""
    if what is None:
        what = (
            f"Tool {call.name!r} hit its soft time limit and gave up without a result "
            f"(hard limit {timeout_s:g}s)."
            if soft
            else f"Tool {call.name!r} was stopped at its hard time limit of {timeout_s:g}s; "
            "its process was killed, so it is not running any more."
            if killed
            else f"Tool {call.name!r} did not answer within {timeout_s:g}s; "
            "it may still be running in the background."
        )
    advice = (
        "Try a smaller or simpler request, split the work into steps, or pass "
        '"_meta": {"timeout_s": N} in the arguments to ask for more time '
        "(up to the tool's ceiling)."
    )
    record = {"timeout_s": timeout_s, "soft_limited": soft, **record}
    return _result(call, "timeout", {"error": what, "advice": advice}, record, error=what)


def waitpoint_timeout(call: ToolCall, waitpoint: dict[str, Any]) -> ToolResult:
    """A waitpoint nobody completed by its deadline (`waitpoint`: its record)."""
    timeout_s = float(waitpoint["timeout_s"])
    what = (
        f"Tool {call.name!r} waited {timeout_s:g}s for waitpoint {waitpoint['id']} and "
        "nobody completed it; it is closed now."
    )
    record = {f: waitpoint.get(f) for f in ("task_id", "worker", "started_at")}
    record.update(timeout_s=timeout_s, waitpoint_id=waitpoint["id"])
    return _result(call, "timeout", {"error": what}, record, error=what)


def cancelled_result(call: ToolCall, reason: str = "user", **record: Any) -> ToolResult:
    msg = f"Tool {call.name!r} was cancelled because the turn was aborted ({reason})."
    return _result(
        call, "cancelled", {"reason": reason, "error": msg}, record, error=msg, reason=reason
    )


def denied_result(call: ToolCall, reason: str, **record: Any) -> ToolResult:
    """The typed result of the approval gate; `reason` is timeout, user or policy."""
    return _result(
        call, "denied", {"decider": "mode_gate", "reason": reason}, record, reason=reason
    )


def lost_result(call: ToolCall, why: str, **record: Any) -> ToolResult:
    msg = (
        f"Tool {call.name!r} was lost: {why}. It is unknown whether it had any effect; "
        "check before running it again."
    )
    return _result(call, "lost", {"error": msg}, record, error=msg)
