"""Send a round's calls as Celery tasks, batch by batch, and settle the ones nobody will:
nothing waits for a call (a step returns when the turn must look again, and each settled
call wakes the turn)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agentq.constants import PICKUP_LEASES, WORKER_ALIVE_TTL_S
from agentq.fleet.broker import publish, queue_size, revoke, task_repr
from agentq.models import ToolResult, ToolTaskRequest
from agentq.orchestrator import subturns
from agentq.orchestrator.plan import CallPlan, batches
from agentq.tools.policy import lost_deadline
from agentq.tools.results import lost_result, waitpoint_timeout

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext

log = logging.getLogger("agentq.dispatch")


def task_id_for(turn_id: str, call_id: str) -> str:
    """A call's task id, the same for each send of it: its start claim runs it once."""
    return f"{turn_id}.{call_id}.1"


def send(
    ctx: StepContext,
    plans: list[CallPlan],
    earlier: dict[str, dict[str, Any]],
    secrets: dict[str, str],
    next_at: float | None,
) -> None:
    """Send the calls as the step's last act: their records go with what it staged as it lets
    go of its lock (a call's start and result find its record), then the messages. A step
    that dies in between leaves calls recorded, unsent: PICKUP_LEASES later they are sent
    again under the same task id (run once by its start claim), `earlier` their records."""
    now = time.time()
    records = {
        p.call.id: {**earlier[p.call.id], "sends": int(earlier[p.call.id].get("sends", 1)) + 1}
        if p.call.id in earlier
        else {
            "tool": p.call.name,
            "task_id": task_id_for(ctx.turn_id, p.call.id),
            "dispatched_at": now,
            "timeout_s": p.timeout_s,
            "soft_timeout_s": p.soft_timeout_s,
            "budget_s": p.budget_s,
            "queue": p.queue,
        }
        for p in plans
    }
    ctx.dispatched.update(records)
    # Before the calls go: a call that settles at once steps the turn, which reports next.
    subturns.report_to_parent(ctx, "calling " + ", ".join(p.call.name for p in plans))
    ctx.release(next_at)
    sent: set[str] = set()
    try:
        for p in plans:
            request = ToolTaskRequest(
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
                kwargs=request.model_dump(),
                task_id=records[p.call.id]["task_id"],
                queue=p.queue,
                argsrepr="()",
                kwargsrepr=task_repr(
                    turn_id=ctx.turn_id, call_id=p.call.id, tool=p.call.name, arguments=p.arguments
                ),
                # The result lives in agentq's store; no backend subscription per send.
                ignore_result=True,
                time_limit=p.timeout_s or None,
                soft_time_limit=p.soft_timeout_s or None,
            )
            sent.add(p.call.id)
    except BaseException:
        # What was not sent is recorded as not sent, for the step after the outage to
        # send at once; a step that took the turn meanwhile sends it after the pickup.
        if ctx.relock():
            ctx.store.unrecord(ctx.turn_id, {c: r for c, r in records.items() if c not in sent})
        raise


def advance_calls(
    ctx: StepContext,
    plans: list[CallPlan],
    settled: dict[str, ToolResult],
    dispatched: dict[str, dict[str, Any]],
    secrets: dict[str, str],
) -> float | None:
    """Send the first unsettled batch and settle its overdue calls; when to look again (None:
    only results wake it). A step that sends calls has let go of the turn on return."""
    for batch in batches(plans):
        waiting = [p for p in batch if p.call.id not in settled]
        if not waiting:
            continue
        tools = [p for p in waiting if not p.subturn_agent]
        fresh = [p for p in tools if p.call.id not in dispatched]
        due: list[float] = []
        subturns.watch(ctx, [p for p in waiting if p.subturn_agent], settled, dispatched, due)
        again = _settle_overdue(ctx, [p for p in tools if p.call.id in dispatched], settled, due)
        if fresh or again:
            out = [*fresh, *(p for p in tools if p.call.id in again)]
            if fresh:
                # Looked at again at the pickup (the step may die before it sends them) and
                # at their queue allowance (not started by then, they are lost).
                s = ctx.settings
                due += [ctx.now + PICKUP_LEASES * s.turn_lease_s]
                due += [ctx.now + s.tool_queue_timeout_s + s.tool_grace_s]
            send(ctx, out, again, secrets, min(due))
        return min(due, default=None)
    return None


def _settle_overdue(
    ctx: StepContext, waiting: list[CallPlan], settled: dict[str, ToolResult], looks: list[float]
) -> dict[str, dict[str, Any]]:
    """Settle the calls sent earlier that nobody will, add when to look again to `looks`; the
    calls recorded and not started after PICKUP_LEASES, to send again, with their records."""
    if not waiting:
        return {}
    starts, dispatched, waits = ctx.store.call_progress(ctx.turn_id)
    s = ctx.settings
    pickup_s = PICKUP_LEASES * s.turn_lease_s
    # A call waiting on its waitpoint holds no worker: only its deadline settles it here.
    for p in [p for p in waiting if p.call.id in waits]:
        wp = waits[p.call.id]
        if ctx.now * 1000 >= wp["deadline_ms"]:
            settled[p.call.id] = ctx.settle(waitpoint_timeout(p.call, wp))[0]
        else:
            looks.append(wp["deadline_ms"] / 1000)
    waiting = [p for p in waiting if p.call.id not in waits]
    dead = _dead_workers(ctx, waiting, starts, looks)
    again: dict[str, dict[str, Any]] = {}
    for p in waiting:
        cid = p.call.id
        start = starts.get(cid)
        sent = dispatched.get(cid, {})
        sent_at = float(sent.get("dispatched_at", ctx.now))
        if start is None and int(sent.get("sends", 1)) == 1:
            if ctx.now >= sent_at + pickup_s:
                again[cid] = sent
            else:
                looks.append(sent_at + pickup_s)
        why = dead.get(cid)
        due = lost_deadline(
            dispatched_at=sent_at,
            started_at=None if start is None else float(start["started_at"]),
            timeout_s=p.timeout_s,
            grace_s=s.tool_grace_s,
            queue_timeout_s=s.tool_queue_timeout_s,
        )
        if why is None and due is not None:
            if ctx.now < due:
                looks.append(due)
            elif start:
                why = "no worker reported a result within its hard limit plus grace"
            else:
                why = "no tool worker picked it up in time"
        if why is None:
            continue  # no limit and a live worker: its result wakes the turn
        again.pop(cid, None)
        task_id = task_id_for(ctx.turn_id, cid)
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
        settled[cid] = ctx.settle(lost)[0]
    return _not_queued(ctx, waiting, again, looks)


def _dead_workers(
    ctx: StepContext,
    waiting: list[CallPlan],
    starts: dict[str, dict[str, Any]],
    looks: list[float],
) -> dict[str, str]:
    """Why each call whose tool worker stopped beating is lost, in one read: a worker that
    died whole loses its calls now, not at their hard limit (or never, without one)."""
    watched: dict[str, str] = {}
    for p in waiting:
        rec = starts.get(p.call.id) or {}
        if not (rec.get("heartbeat") and rec.get("worker")):
            continue
        # A worker's first beat may trail a call it took at once: judge it a beat later.
        judged_at = float(rec["started_at"]) + WORKER_ALIVE_TTL_S
        if ctx.now >= judged_at:
            watched[p.call.id] = str(rec["worker"])
        else:
            looks.append(judged_at)
    alive = ctx.store.workers_alive(sorted(set(watched.values())))
    dead = {
        cid: f"its tool worker {worker} stopped sending heartbeats"
        for cid, worker in watched.items()
        if not alive.get(worker, True)
    }
    if dead:
        # Heartbeats lapse while Redis restarts: judged once Redis was up a heartbeat's life.
        up_s = ctx.store.redis_up_s()
        if up_s is not None and up_s < WORKER_ALIVE_TTL_S:
            looks.append(ctx.now + WORKER_ALIVE_TTL_S - up_s)
            return {}
    return dead


def _not_queued(
    ctx: StepContext,
    waiting: list[CallPlan],
    again: dict[str, dict[str, Any]],
    looks: list[float],
) -> dict[str, dict[str, Any]]:
    """The calls of `again` to send now: one whose queue holds a backlog waits its allowance."""
    queues = {p.call.id: p.queue for p in waiting if p.call.id in again}
    waiting_in = {q: queue_size(ctx.app, q) for q in set(queues.values())}
    held = sorted(c for c, q in queues.items() if waiting_in[q])
    if held:
        log.info(
            "turn %s: calls %s not started after the pickup, their queue holds messages:"
            " not sent again while it does",
            ctx.turn_id,
            ", ".join(held),
        )
        looks.append(ctx.now + PICKUP_LEASES * ctx.settings.turn_lease_s)
    return {c: r for c, r in again.items() if c not in held}
