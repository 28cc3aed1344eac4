"""Send a round's calls as Celery tasks, batch by batch, and settle the ones nobody will.

Nothing here waits for a call: a step sends what may run now, settles what is overdue,
and returns when the turn must look again (the earliest lost-deadline). Each settled
call wakes the turn by itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from agentq.constants import WORKER_ALIVE_TTL_S
from agentq.fleet.broker import publish, revoke, task_repr
from agentq.models import ToolResult, ToolTaskRequest
from agentq.orchestrator import subturns
from agentq.orchestrator.plan import CallPlan, batches
from agentq.telemetry import tracing
from agentq.tools.results import lost_result
from agentq.tools.timing import lost_deadline

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


def task_id_for(turn_id: str, call_id: str, attempt: int) -> str:
    return f"{turn_id}.{call_id}.{attempt}"


def send(
    ctx: StepContext, plans: list[CallPlan], secrets: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Send the calls; their dispatch records are written when the step lets go of its
    lock (in the same write). Returns the records.

    A step that dies (or loses its lock) before that leaves calls sent but not recorded:
    the step that takes over sends them again under the same task ids, and a call's start
    claim runs each once (a second delivery of a started call is refused, one of a settled
    call too). Recording first put a round trip between the step and the call's message.
    """
    if not plans:
        return {}
    now = time.time()
    records = {
        p.call.id: {
            "tool": p.call.name,
            "task_id": task_id_for(ctx.turn_id, p.call.id, 1),
            "dispatched_at": now,
            "timeout_s": p.timeout_s,
            "soft_timeout_s": p.soft_timeout_s,
            "budget_s": p.budget_s,
            "queue": p.queue,
        }
        for p in plans
    }
    for p in plans:
        req = ToolTaskRequest(
            turn_id=ctx.turn_id,
            call_id=p.call.id,
            tool=p.call.name,
            arguments=p.arguments,
            timeout_s=p.timeout_s,
            soft_timeout_s=p.soft_timeout_s or None,
            budget_s=p.budget_s,
            secret_ref=secrets.get(p.call.id),
            traceparent=ctx.state.get("traceparent"),
        )
        publish(
            ctx.app,
            p.task_name,
            what=f"call {p.call.id} of turn {ctx.turn_id}",
            kwargs=req.model_dump(),
            task_id=records[p.call.id]["task_id"],
            queue=p.queue,
            argsrepr="()",
            kwargsrepr=task_repr(
                turn_id=ctx.turn_id, call_id=p.call.id, tool=p.call.name, arguments=p.arguments
            ),
            # The result lives in agentq's store; no backend subscription per send.
            ignore_result=True,
            **p.limits.celery_options,
        )
        # Recorded one by one: when the broker fails mid-batch, the calls not sent stay
        # undispatched and the next step sends them.
        ctx.dispatched[p.call.id] = records[p.call.id]
    subturns.report_to_parent(ctx, "calling " + ", ".join(p.call.name for p in plans))
    return records


def advance_calls(
    ctx: StepContext,
    plans: list[CallPlan],
    settled: dict[str, ToolResult],
    dispatched: dict[str, dict[str, Any]],
    secrets: dict[str, str],
) -> float | None:
    """Send the first batch that is not settled yet and settle its overdue calls.

    Returns when the turn must look again, or None when it waits only for results (each
    wakes it); every call of `plans` is in `settled` when the batches are all done.
    """
    for batch in batches(plans):
        waiting = [p for p in batch if p.call.id not in settled]
        if not waiting:
            continue
        tools = [p for p in waiting if not p.subturn_agent]
        agents = [p for p in waiting if p.subturn_agent]
        sent = send(ctx, [p for p in tools if p.call.id not in dispatched], secrets)
        fresh = [p for p in agents if p.call.id not in dispatched]
        dispatched = {**dispatched, **subturns.record(ctx, fresh)}
        due = [
            t
            for t in (
                _settle_overdue(ctx, tools, settled, sent if len(sent) == len(tools) else None),
                subturns.watch(ctx, agents, settled, dispatched),
            )
            if t is not None
        ]
        return min(due) if due else None
    return None


def _settle_overdue(
    ctx: StepContext,
    waiting: list[CallPlan],
    settled: dict[str, ToolResult],
    just_sent: dict[str, dict[str, Any]] | None = None,
) -> float | None:
    """Settle the calls nobody will settle; return when to look again.

    `just_sent`: every waiting call was sent by this step, with these records. Nothing
    can be overdue yet and no start is known: the deadline is the queue allowance, as it
    was when the read came before the starts; a worker that dies whole wakes the turn by
    its heartbeat, and any later step reads the starts.
    """
    if not waiting:
        return None
    if just_sent is not None:
        starts: dict[str, dict[str, Any]] = {}
        dispatched = just_sent
    else:
        starts = ctx.store.starts(ctx.turn_id)
        dispatched = ctx.store.dispatches(ctx.turn_id)
    s = ctx.settings
    # A worker that died whole (no parent left to report the kill) stops its heartbeat:
    # its calls are lost now, not at their hard limit, or never for tools without one.
    watched: dict[str, str] = {}
    next_at: float | None = None
    for p in waiting:
        rec = starts.get(p.call.id) or {}
        if not (rec.get("heartbeat") and rec.get("worker")):
            continue
        # A worker's first beat may trail a call it took at once: judge it a beat later.
        judged_at = float(rec["started_at"]) + WORKER_ALIVE_TTL_S
        if ctx.now >= judged_at:
            watched[p.call.id] = str(rec["worker"])
        else:
            next_at = judged_at if next_at is None else min(next_at, judged_at)
    alive = ctx.store.workers_alive(sorted(set(watched.values())))
    for p in waiting:
        cid = p.call.id
        start = starts.get(cid)
        why: str | None = None
        if cid in watched and not alive.get(watched[cid], True):
            why = f"its tool worker {watched[cid]} stopped sending heartbeats"
        else:
            due = lost_deadline(
                dispatched_at=float(dispatched.get(cid, {}).get("dispatched_at", ctx.now)),
                started_at=None if start is None else float(start["started_at"]),
                timeout_s=p.timeout_s,
                grace_s=s.tool_grace_s,
                queue_timeout_s=s.tool_queue_timeout_s,
            )
            if due is not None and ctx.now < due:
                next_at = due if next_at is None else min(next_at, due)
                continue
            if due is not None:
                why = (
                    "no worker reported a result within its hard limit plus grace"
                    if start
                    else "no tool worker picked it up in time"
                )
        if why is None:
            continue  # no limit and a live worker: its result wakes the turn
        settled[cid] = _settle_lost(ctx, p, why, start)
    return next_at


def _settle_lost(
    ctx: StepContext, p: CallPlan, why: str, start: dict[str, Any] | None
) -> ToolResult:
    task_id = task_id_for(ctx.turn_id, p.call.id, 1)
    revoke(ctx.app, task_id, terminate=True, signal="SIGKILL")
    lost = lost_result(
        p.call,
        why,
        task_id=task_id,
        timeout_s=p.timeout_s,
        budget_s=p.budget_s,
        started_at=None if start is None else start.get("started_at"),
        worker=None if start is None else start.get("worker"),
    )
    if ctx.store.settle(ctx.turn_id, lost, wake=False):
        if tracing.enabled:
            tracing.record_settled(ctx.state.get("traceparent"), ctx.turn_id, lost)
        return lost
    # A real result that landed meanwhile wins: keep the one Redis holds.
    return ctx.store.result(ctx.turn_id, p.call.id) or lost
