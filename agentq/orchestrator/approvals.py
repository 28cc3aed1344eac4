"""The approval gate: `ask` tools wait for an answer with a finite timeout; silence denies."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from agentq import constants as k
from agentq.errors import HeadlessInteraction
from agentq.interactions import Interactions, default_timeout_s
from agentq.models import InteractionRequest, ToolCall, ToolResult
from agentq.orchestrator.context import TurnContext
from agentq.orchestrator.dispatch import Prepared, prepare
from agentq.results import denied_result


@dataclass
class GateOutcome:
    denied: dict[str, ToolResult] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    """call id -> Redis key of a password answer, handed to the tool by reference."""


def _prompt(p: Prepared) -> str:
    args = json.dumps(p.arguments, ensure_ascii=False)
    if len(args) > 500:
        args = args[:500] + "..."
    return f"Allow {p.call.name}({args})?"


def gate(ctx: TurnContext, calls: list[ToolCall]) -> GateOutcome:
    out = GateOutcome()
    asks: dict[str, tuple[ToolCall, InteractionRequest]] = {}
    interactions = Interactions(ctx.store)
    for call in calls:
        p = prepare(call, max_arguments_bytes=ctx.settings.max_arguments_bytes)
        if not isinstance(p, Prepared):
            continue
        pol = p.spec.policy
        if pol.approval == "deny":
            out.denied[call.id] = denied_result(call, "policy")
            ctx.publish("tool_denied", call_id=call.id, tool=call.name, reason="policy")
            continue
        if pol.approval != "ask":
            continue
        timeout_s = pol.approval_timeout_s or default_timeout_s(pol.approval_kind, ctx.settings)
        assert timeout_s is not None  # checked when the tool was declared
        req = InteractionRequest(
            request_id=f"{call.id}.approval",
            kind=pol.approval_kind,
            call_id=call.id,
            tool=call.name,
            prompt=_prompt(p),
            timeout_ms=int(timeout_s * 1000),
            default=pol.approval_default,
        )
        found = interactions.get(ctx.turn_id, req.request_id)
        if found is None:
            interactions.open(ctx.turn_id, req)
            ctx.publish("interaction_requested", **req.model_dump(), headless=ctx.headless)
            asks[req.request_id] = (call, req)
            continue
        # A resumed turn: the request was made before. Its answer may have been taken
        # from the inbox by the worker that died, so the request's own record decides.
        state, stored = found
        if state == "pending":
            asks[req.request_id] = (call, stored)  # the original clock, not a new one
        elif state == "answered":
            decision = interactions.decision(ctx.turn_id, req.request_id)
            if decision != "approve":
                out.denied[call.id] = denied_result(call, "user")
            elif stored.kind == "password":
                out.secrets[call.id] = k.secret_key(ctx.turn_id, req.request_id)
        elif state == "defaulted":
            if stored.default != "approve":
                out.denied[call.id] = denied_result(call, "policy")
        else:
            out.denied[call.id] = denied_result(call, "timeout")

    if ctx.headless:
        for rid, (call, req) in asks.items():
            if req.default is None:
                raise HeadlessInteraction(ctx.turn_id, rid, req.kind)
            interactions.expire(ctx.turn_id, rid, state="defaulted")
            ctx.publish("interaction_answered", request_id=rid, decision=req.default, by="default")
            if req.default == "deny":
                out.denied[call.id] = denied_result(call, "policy")
                ctx.publish("tool_denied", call_id=call.id, tool=call.name, reason="policy")
        return out

    deadlines = {rid: req.created_at + req.timeout_ms / 1000 for rid, (_, req) in asks.items()}
    while deadlines:
        rid_next = min(deadlines, key=lambda r: deadlines[r])
        if time.time() >= deadlines[rid_next]:
            call, req = asks[rid_next]
            del deadlines[rid_next]
            if interactions.expire(ctx.turn_id, rid_next):
                ctx.publish(
                    "interaction_timed_out",
                    request_id=rid_next,
                    call_id=call.id,
                    timeout_ms=req.timeout_ms,
                )
                out.denied[call.id] = denied_result(call, "timeout")
                ctx.publish("tool_denied", call_id=call.id, tool=call.name, reason="timeout")
            continue
        msg = ctx.wait_until(deadlines[rid_next])
        if msg is None:
            continue
        if msg.get("kind") != "answer" or msg.get("request_id") not in deadlines:
            ctx.deferred.append(msg)
            continue
        rid = str(msg["request_id"])
        call, req = asks[rid]
        del deadlines[rid]
        ctx.publish("interaction_answered", request_id=rid, decision=msg["decision"], by="user")
        if msg["decision"] != "approve":
            out.denied[call.id] = denied_result(call, "user")
            ctx.publish("tool_denied", call_id=call.id, tool=call.name, reason="user")
        elif req.kind == "password" and msg.get("has_value"):
            out.secrets[call.id] = k.secret_key(ctx.turn_id, rid)
    return out
