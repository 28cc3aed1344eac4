"""Send one round of tool calls as Celery tasks and collect them as each settles."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from agentq.constants import WORKER_ALIVE_TTL_S
from agentq.errors import AgentqError, ToolArgumentsInvalid
from agentq.models import ToolCall, ToolResult, ToolTaskRequest
from agentq.orchestrator.context import TurnContext
from agentq.results import error_result, lost_result
from agentq.timing import Limits, effective_limits, lost_deadline, split_meta
from agentq.tools.registry import ToolSpec, get_tool, parse_arguments


@dataclass(frozen=True)
class Prepared:
    """A call that passed every check and may be sent to a worker."""

    call: ToolCall
    spec: ToolSpec
    arguments: dict[str, Any]
    limits: Limits

    @property
    def exclusive(self) -> bool:
        return self.spec.policy.concurrency == "exclusive"


def prepare(call: ToolCall, *, max_arguments_bytes: int) -> Prepared | ToolResult:
    """Validate a call the model made; a problem becomes an `error` result it can act on."""
    try:
        spec = get_tool(call.name)
        size = len(call.arguments.encode("utf-8"))
        if size > max_arguments_bytes:
            raise ToolArgumentsInvalid(
                call.name,
                f"arguments are {size} bytes, over the limit of {max_arguments_bytes} bytes; "
                "pass a reference (a path, an id) instead of the data",
            )
        raw = parse_arguments(call.name, call.arguments)
        args, hint_s, problem = split_meta(raw)
        if problem:
            raise ToolArgumentsInvalid(call.name, problem)
        validated = spec.validate(args)
    except AgentqError as exc:
        return error_result(call, exc.message)
    pol = spec.policy
    limits = effective_limits(
        timeout_s=pol.timeout_s,
        soft_timeout_s=pol.soft_timeout_s,
        budget_s=pol.budget_s,
        max_timeout_s=pol.max_timeout_s,
        hint_s=hint_s,
    )
    return Prepared(call, spec, validated.model_dump(mode="json"), limits)


def plan_batches(prepared: list[Prepared]) -> list[list[Prepared]]:
    """Consecutive parallel calls share a batch; an exclusive call is a batch of its own."""
    batches: list[list[Prepared]] = []
    for p in prepared:
        if p.exclusive or not batches or batches[-1][0].exclusive:
            batches.append([p])
        else:
            batches[-1].append(p)
    return batches


def task_id_for(turn_id: str, call_id: str, attempt: int) -> str:
    return f"{turn_id}.{call_id}.{attempt}"


class RoundDispatcher:
    """Runs the calls of one round; every call ends with exactly one settled result."""

    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx
        self.settled: dict[str, ToolResult] = {}
        self.lost_why: dict[str, str] = {}

    def run(
        self,
        calls: list[ToolCall],
        *,
        presettled: dict[str, ToolResult] | None = None,
        secrets: dict[str, str] | None = None,
    ) -> list[ToolResult]:
        ctx = self.ctx
        # Only this round's calls: earlier results of the turn are not read again.
        self.settled, dispatched = ctx.store.round_view(ctx.turn_id, [c.id for c in calls])
        runnable: list[Prepared] = []
        for call in calls:
            if call.id in self.settled:
                continue
            pre = (presettled or {}).get(call.id)
            outcome = (
                pre
                if pre is not None
                else prepare(call, max_arguments_bytes=ctx.settings.max_arguments_bytes)
            )
            if isinstance(outcome, ToolResult):
                won = ctx.store.settle(ctx.turn_id, outcome)
                stored = None if won else ctx.store.result(ctx.turn_id, call.id)
                self.settled[call.id] = stored or outcome
            else:
                runnable.append(outcome)
        try:
            for batch in plan_batches(runnable):
                fresh = [p for p in batch if p.call.id not in dispatched]
                self._send(fresh, secrets or {})
                self._collect(batch, all_fresh=len(fresh) == len(batch))
        finally:
            # A tool reads its password once; if it died, was lost or was aborted
            # first, the password must not outlive the round.
            if secrets:
                ctx.store.redis.delete(*secrets.values())
        return [self.settled[c.id] for c in calls]

    def _send(self, batch: list[Prepared], secrets: dict[str, str]) -> None:
        ctx = self.ctx
        now = time.time()
        records = {
            p.call.id: {
                "tool": p.call.name,
                "task_id": task_id_for(ctx.turn_id, p.call.id, 1),
                "dispatched_at": now,
                "timeout_s": p.limits.timeout_s,
                "budget_s": p.limits.budget_s,
            }
            for p in batch
        }
        # Recorded before sending: a turn resumed elsewhere then waits instead of resending.
        ctx.store.record_dispatch(ctx.turn_id, records)
        for p in batch:
            req = ToolTaskRequest(
                turn_id=ctx.turn_id,
                call_id=p.call.id,
                tool=p.call.name,
                arguments=p.arguments,
                timeout_s=p.limits.timeout_s,
                soft_timeout_s=p.limits.soft_timeout_s or None,
                budget_s=p.limits.budget_s,
                secret_ref=secrets.get(p.call.id),
            )
            ctx.app.send_task(
                p.spec.task_name,
                kwargs=req.model_dump(),
                task_id=records[p.call.id]["task_id"],
                queue=p.spec.policy.queue,
                # The result lives in agentq's store; no backend subscription per send.
                ignore_result=True,
                **p.limits.celery_options,
            )

    def _collect(self, batch: list[Prepared], *, all_fresh: bool = False) -> None:
        ctx = self.ctx
        waiting = {p.call.id: p for p in batch if p.call.id not in self.settled}
        progress_every = ctx.settings.progress_interval_s
        now = time.time()
        next_progress = now + progress_every
        next_deadline_check = now
        deadlines: dict[str, float | None] = {}
        if all_fresh:
            # Calls sent a moment ago cannot be overdue: start from what we know and
            # ask Redis about their starts only after a second.
            next_deadline_check = now + 1.0
            deadlines = {
                cid: lost_deadline(
                    dispatched_at=now,
                    started_at=None,
                    timeout_s=p.limits.timeout_s,
                    grace_s=ctx.settings.tool_grace_s,
                    queue_timeout_s=ctx.settings.tool_queue_timeout_s,
                )
                for cid, p in waiting.items()
            }
        while waiting:
            now = time.time()
            if now >= next_deadline_check:
                deadlines = self._deadlines(waiting)
                # Starts are polled, not pushed: once a second is enough to learn a
                # hard-limit deadline, since the worker itself reports the kill at once.
                next_deadline_check = now + 1.0
                now = time.time()
            # Every due deadline is acted on now, not at the next poll: a deadline in the
            # past would otherwise make the wait below return at once, again and again.
            for cid, when in list(deadlines.items()):
                if cid in waiting and when is not None and now >= when:
                    self._settle_lost(waiting.pop(cid))
                    deadlines.pop(cid)
            if not waiting:
                break
            if now >= next_progress:
                self._publish_progress(waiting)
                next_progress = now + progress_every
            wake = min(
                [next_progress, next_deadline_check]
                + [d for d in deadlines.values() if d is not None]
            )
            msg = ctx.wait_until(wake)
            if msg is None:
                continue
            if msg.get("kind") == "result":
                result = ToolResult.model_validate(msg["result"])
                self.settled[result.call_id] = result
                waiting.pop(result.call_id, None)
            else:
                ctx.deferred.append(msg)
                if len(ctx.deferred) > 100:
                    ctx.deferred.pop(0)

    def _deadlines(self, waiting: dict[str, Prepared]) -> dict[str, float | None]:
        ctx = self.ctx
        starts = ctx.store.starts(ctx.turn_id)
        dispatched = ctx.store.dispatches(ctx.turn_id)
        now = time.time()
        out: dict[str, float | None] = {}
        for cid, p in waiting.items():
            d = dispatched.get(cid, {})
            s = starts.get(cid)
            out[cid] = lost_deadline(
                dispatched_at=float(d.get("dispatched_at", now)),
                started_at=None if s is None else float(s["started_at"]),
                timeout_s=p.limits.timeout_s,
                grace_s=ctx.settings.tool_grace_s,
                queue_timeout_s=ctx.settings.tool_queue_timeout_s,
            )
        # A worker that died whole (no parent left to report the kill) stops its
        # heartbeat: its calls are lost now, not at their hard limit, or never for
        # tools without one.
        watched = {
            cid: str(s["worker"])
            for cid, s in starts.items()
            if cid in waiting
            and s.get("heartbeat")
            and s.get("worker")
            and now - float(s["started_at"]) > WORKER_ALIVE_TTL_S
        }
        alive = ctx.store.workers_alive(sorted(set(watched.values())))
        for cid, worker in watched.items():
            if not alive.get(worker, True):
                out[cid] = 0.0  # due at once
                self.lost_why[cid] = f"its tool worker {worker} stopped sending heartbeats"
        return out

    def _settle_lost(self, p: Prepared) -> None:
        ctx = self.ctx
        start = ctx.store.starts(ctx.turn_id).get(p.call.id)
        why = self.lost_why.get(p.call.id) or (
            "no worker reported a result within its hard limit plus grace"
            if start
            else "no tool worker picked it up in time"
        )
        task_id = task_id_for(ctx.turn_id, p.call.id, 1)
        ctx.app.control.revoke(task_id, terminate=True, signal="SIGKILL")
        lost = lost_result(
            p.call,
            why,
            task_id=task_id,
            timeout_s=p.limits.timeout_s,
            budget_s=p.limits.budget_s,
            started_at=None if start is None else start.get("started_at"),
            worker=None if start is None else start.get("worker"),
        )
        won = ctx.store.settle(ctx.turn_id, lost)
        # A real result that landed meanwhile wins: keep the one Redis holds.
        self.settled[p.call.id] = lost if won else ctx.store.result(ctx.turn_id, p.call.id) or lost

    def _publish_progress(self, waiting: dict[str, Prepared]) -> None:
        ctx = self.ctx
        starts = ctx.store.starts(ctx.turn_id)
        now = time.time()
        for cid, p in waiting.items():
            s = starts.get(cid)
            ctx.publish(
                "tool_progress",
                call_id=cid,
                tool=p.call.name,
                elapsed_ms=int((now - float(s["started_at"])) * 1000) if s else 0,
                state="running" if s else "queued",
                source="turn",
            )


def canonical_call(call: ToolCall) -> str:
    """The identity the loop detector compares: tool plus normalised arguments."""
    try:
        args: Any = json.loads(call.arguments or "{}")
        norm = json.dumps(args, sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        norm = call.arguments
    return f"{call.name}:{norm}"
