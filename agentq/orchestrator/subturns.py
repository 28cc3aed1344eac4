"""Agents called as tools: a call that runs a child turn instead of a Celery task. The
child's end settles the call in the same atomic write (`TurnStore.close`); the parent's
step only watches the call's hard limit, where it aborts the child (docs/agents.md)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.models import TERMINAL_STATUSES, ToolCall, ToolResult
from agentq.orchestrator.wake import request_abort, send_step_or_wake
from agentq.state.base import WAKE_BACKSTOP_S
from agentq.state.turn_state import queued_state
from agentq.tools.policy import truncate_text
from agentq.tools.results import cancelled_result, error_result, ok_result, timeout_result

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext
    from agentq.orchestrator.plan import CallPlan

BEAT_SHARE = 0.9
"""A heartbeat every this share of `progress_interval_s`: a sweeper wakes its step a bit late."""


def child_turn_id(turn_id: str, call_id: str) -> str:
    """Derived (a step that takes over finds it), in the parent's shard (its first 4 hex digits)."""
    return turn_id[:4] + hashlib.sha256(f"{turn_id}/{call_id}".encode()).hexdigest()[:28]


def watch(
    ctx: StepContext,
    waiting: list[CallPlan],
    settled: dict[str, ToolResult],
    dispatched: dict[str, dict[str, Any]],
    looks: list[float],
) -> None:
    """Record and start the calls' child turns, settle the calls past their hard limit (the
    child aborted), add to `looks` when to look again (a limit, a heartbeat)."""
    if not waiting:
        return
    ctx.flush()  # the turn's own events come before its children's
    new = {
        p.call.id: {
            "tool": p.call.name,
            "agent": p.subturn_agent,
            "child_turn_id": child_turn_id(ctx.turn_id, p.call.id),
            "dispatched_at": time.time(),
            "timeout_s": p.timeout_s,
        }
        for p in waiting
        if p.call.id not in dispatched
    }
    ctx.store.record_dispatch(ctx.turn_id, new)
    dispatched = {**dispatched, **new}
    beat_s = ctx.settings.progress_interval_s * BEAT_SHARE
    pipe = ctx.store.redis.pipeline(transaction=False)
    for p in waiting:
        pipe.hmget(k.turn_key(dispatched[p.call.id]["child_turn_id"]), ["status", "progress"])
        # At most one heartbeat per call per beat_s, however many steps look.
        pipe.set(k.turn_key(ctx.turn_id, "beat", p.call.id), 1, nx=True, px=int(beat_s * 900))
    replies = pipe.execute()
    for i, p in enumerate(waiting):
        (raw, progress), beat = replies[2 * i], replies[2 * i + 1]
        rec = dispatched[p.call.id]
        child, since = str(rec["child_turn_id"]), float(rec["dispatched_at"])
        if raw is None:
            _start_child(ctx, p, child)
        elif json.loads(raw) in TERMINAL_STATUSES:
            # Its end settled this call in the same write (`TurnStore.close`), unless Redis
            # lost the child's state and `end_lost_turn` ended it: its error is the call's.
            result = ctx.store.result(ctx.turn_id, p.call.id)
            if result is None:
                why = str((ctx.store.state(child) or {}).get("error") or "")
                result, _ = ctx.settle(_failed(p.call, why, task_id=child, started_at=since))
            settled[p.call.id] = result
            continue
        elif beat:
            message = json.loads(progress) if progress else "starting"
            fields = _progress(ctx, p.call.id, p.call.name, p.subturn_agent, child, message, since)
            ctx.publish("tool_progress", **fields)
        # The next heartbeat: a parent holds no process, so its step is woken for it.
        looks.append(ctx.now + beat_s)
        if p.timeout_s <= 0:
            continue
        due = since + p.timeout_s
        if ctx.now < due:
            looks.append(due)
            continue
        result = timeout_result(
            p.call,
            p.timeout_s,
            killed=True,
            what=f"Agent {p.subturn_agent!r} did not answer within {p.timeout_s:g}s; "
            "its turn was aborted.",
            started_at=since,
            task_id=child,
        )
        settled[p.call.id], _ = ctx.settle(result)
        request_abort(ctx.store, child, "timeout", walk=False)


def _progress(
    ctx: StepContext, call_id: str, tool: Any, agent: Any, child: str, message: str, since: float
) -> dict[str, Any]:
    """A `tool_progress` of an agent call (its child's phase), running since `since`."""
    return {
        "call_id": call_id,
        "tool": tool,
        "message": message,
        "pct": None,
        "elapsed_ms": int(max(0.0, ctx.now - since) * 1000),
        "source": "agent",
        "agent": agent,
        "child_turn_id": child,
    }


def _start_child(ctx: StepContext, p: CallPlan, child: str) -> None:
    state = ctx.state
    now = time.time()
    child_state = queued_state(
        # The parent's token steers its children too: it answers their approvals.
        state["token_sha256"],
        created_at=now,
        headless=bool(state.get("headless")),
        detach=True,
        # A sub-agent works for whoever waits on its parent: its rounds keep their place.
        interactive=ctx.interactive,
        conversation_id=None,
        parent_turn_id=ctx.turn_id,
        parent_call_id=p.call.id,
        parent_tool=p.call.name,
        # Its rounds count against its parents' budgets too (docs/spend.md).
        budget_ancestors=[*(state.get("budget_ancestors") or []), ctx.turn_id],
        agent=p.subturn_agent,
        owner=state.get("owner"),
    )
    history = [{"role": "user", "content": str(p.arguments["prompt"])}]
    # The step is sent below; should it be lost, a sweeper steps the child soon.
    ctx.store.create(child, child_state, history, backstop_s=WAKE_BACKSTOP_S)
    # A start record without a worker: shown running, no worker heartbeat watched.
    ctx.store.redis.hset(
        k.turn_key(ctx.turn_id),
        k.STARTED + p.call.id,
        json.dumps({"started_at": now, "child_turn_id": child, "worker": None}),
    )
    fields = {"call_id": p.call.id, "tool": p.call.name, "agent": p.subturn_agent}
    ctx.publish("subturn_started", **fields, child_turn_id=child)
    ctx.publish("tool_started", **fields, child_turn_id=child, timeout_s=p.timeout_s)
    send_step_or_wake(ctx.store, ctx.app, child)


def report_to_parent(ctx: StepContext, message: str) -> None:
    """A child turn's step, shown on its parent's stream as `tool_progress` of its call."""
    state = ctx.state
    parent, call_id = state.get("parent_turn_id"), state.get("parent_call_id")
    if not parent or not call_id:
        return
    # Kept for the parent's heartbeats while this phase lasts.
    ctx.store.update(ctx.turn_id, progress=message)
    tool, agent = state.get("parent_tool"), state.get("agent")
    since = float(state.get("created_at") or ctx.now)
    fields = _progress(ctx, call_id, tool, agent, ctx.turn_id, message, since)
    ctx.store.bus.publish(str(parent), "tool_progress", **fields)


def parent_settlement(ctx: StepContext, status: str, said: str) -> tuple[str, ToolResult] | None:
    """For a child started by an agent call: (parent turn id, the call's result from how the
    child ended, `said` being its answer or why it did not)."""
    state = ctx.state
    parent, call_id = state.get("parent_turn_id"), state.get("parent_call_id")
    if not parent or not call_id:
        return None
    call = ToolCall(id=str(call_id), name=str(state.get("parent_tool") or "agent"))
    extra: dict[str, Any] = {
        "task_id": ctx.turn_id,
        "started_at": float(state.get("created_at") or ctx.now),
    }
    if status == "finished":
        body, cut = truncate_text(said, ctx.settings.max_result_bytes)
        return str(parent), ok_result(call, body, cut, **extra)
    if status == "aborted":
        return str(parent), cancelled_result(call, said or "user", **extra)
    return str(parent), _failed(call, said, **extra)


def _failed(call: ToolCall, why: str, **extra: Any) -> ToolResult:
    return error_result(call, f"the agent's turn failed: {why or 'unknown error'}", **extra)
