"""The approval gate: `ask` calls wait for an answer with a finite timeout; silence denies.
The gate never waits: each step decides from the requests' records (a step that takes over
decides the same); a pending one is the turn's next deadline, an answer wakes it."""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.errors import HeadlessInteraction
from agentq.models import InteractionRequest, ToolResult
from agentq.orchestrator.plan import CallPlan
from agentq.state.interactions import default_timeout_s
from agentq.tools.results import denied_result, error_result, ok_result

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


@dataclass
class GateOutcome:
    results: dict[str, ToolResult] = field(default_factory=dict)
    """call id -> the gate's result: refused (its plan's refusal), denied, or an `input` answer."""
    secrets: dict[str, str] = field(default_factory=dict)
    """call id -> Redis key of a password answer, handed to the tool by reference."""
    wait_until: float | None = None
    """The earliest timeout of a request still pending; None when every call is decided."""


def gate(ctx: StepContext, plans: list[CallPlan], settled: Container[str] = ()) -> GateOutcome:
    """Decide what can be decided now; a call in `settled` is not asked about."""
    out = GateOutcome()
    for p in plans:
        call = p.call
        if p.refusal is not None:
            out.results[call.id] = error_result(call, p.refusal)
        elif p.approval == "deny":
            out.results[call.id] = denied_result(call, "policy")
        if p.refusal is not None or p.approval != "ask":
            continue
        rid = k.approval_request_id(call.id)
        found = ctx.store.interaction(ctx.turn_id, rid)
        if found is None:
            if call.id in settled:
                continue
            found = _ask(ctx, p, rid)
        state, req = found
        if state == "pending":
            deadline = req.created_at + req.timeout_ms / 1000
            if ctx.now < deadline:
                out.wait_until = min(out.wait_until or deadline, deadline)
                continue
            # Past its timeout: timed out, unless an answer won the race (its state stays).
            ctx.flush()  # interaction_timed_out after what the step staged
            state = ctx.store.expire_interaction(ctx.turn_id, req)
        # Closed: the call runs (with a password's secret), takes the answer, or is denied.
        # Defaulted only by a headless turn, to a declared default (an input's: its answer).
        approved = (
            state == "answered" and ctx.store.interaction_decision(ctx.turn_id, rid) == "approve"
        ) or (state == "defaulted" and req.default == "approve")
        if not approved:
            why = {"answered": "user", "defaulted": "policy"}.get(state, "timeout")
            out.results[call.id] = denied_result(call, why)
        elif req.kind == "input":
            # The answer, as JSON, is the call's result (a defaulted one: the declared default).
            raw = ctx.store.redis.get(k.turn_key(ctx.turn_id, "secret", rid))
            content = raw.decode() if isinstance(raw, bytes) else json.dumps(req.default_answer)
            out.results[call.id] = ok_result(call, content, started_at=req.created_at)
        elif req.kind == "password":
            out.secrets[call.id] = k.turn_key(ctx.turn_id, "secret", rid)
    return out


def _ask(ctx: StepContext, p: CallPlan, rid: str) -> tuple[str, InteractionRequest]:
    """Open the call's request; a headless turn takes its default at once (or raises)."""
    timeout_s = p.approval_timeout_s or default_timeout_s(p.approval_kind, ctx.settings)
    assert timeout_s is not None  # checked when the tool was declared
    asked: dict[str, Any] = {
        "request_id": rid,
        "call_id": p.call.id,
        "tool": p.call.name,
        "timeout_ms": int(timeout_s * 1000),
    }
    if p.approval_kind == "input":
        # A question: its prompt, schema and headless answer are the call's arguments.
        default_answer = p.arguments.get("default")
        asked |= {
            "prompt": str(p.arguments.get("question") or ""),
            "default": None if default_answer is None else "approve",
            "answer_schema": p.arguments.get("answer_schema"),
            "default_answer": default_answer,
        }
    else:
        args = json.dumps(p.arguments, ensure_ascii=False)
        if len(args) > 500:
            args = args[:500] + "..."
        asked |= {"prompt": f"Allow {p.call.name}({args})?", "default": p.approval_default}
    req = InteractionRequest(**asked, kind=p.approval_kind)
    ctx.store.open_interaction(ctx.turn_id, req)
    # `agent` names who asks when the request is relayed into a parent's stream.
    ctx.publish(
        "interaction_requested",
        **req.model_dump(),
        headless=ctx.headless,
        agent=ctx.state.get("agent"),
    )
    if not ctx.headless:
        return "pending", req
    if req.default is None:
        raise HeadlessInteraction(ctx.turn_id, rid, req.kind)
    return ctx.store.expire_interaction(ctx.turn_id, req, state="defaulted"), req
