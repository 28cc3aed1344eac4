"""Ending a round early: revoke a turn's unfinished tasks and give every call a result."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.fleet.broker import broadcast, revoke
from agentq.models import ToolCall, ToolResult
from agentq.orchestrator.plan import pending_calls

if TYPE_CHECKING:
    import redis
    from celery import Celery

    from agentq.orchestrator.context import StepContext


def revoke_unsettled(ctx: StepContext) -> list[str]:
    """SIGTERM the turn's started tasks now (one not started never runs: its start sees the
    cancel flag), SIGKILL what is left after a grace: a durable order in Redis the sweepers
    send when due (`send_kills`), so a tool that ignores SIGTERM dies even when the process
    that aborted has long exited."""
    running = ctx.store.running_tasks(ctx.turn_id)
    if not running:
        return []
    ids = list(running)
    workers = [start.get("worker") for start in running.values()]
    # A start record without a worker name (never expected) falls back to a broadcast.
    destination = sorted({str(w) for w in workers}) if all(workers) else None
    revoke(ctx.app, ids, terminate=True, signal="SIGTERM", destination=destination)
    # Celery forgets a task once it has terminated it, so a second revoke with SIGKILL
    # would find nothing: the escalation names the pool processes themselves.
    targets = [[tid, start.get("pid")] for tid, start in running.items() if start.get("pid")]
    if targets:
        order = json.dumps({"targets": targets, "to": destination}, separators=(",", ":"))
        ctx.store.redis.zadd(k.KILLS, {order: time.time() + ctx.settings.abort_kill_grace_s})
    return ids


def send_kills(r: redis.Redis, app: Celery, due: list[bytes]) -> int:
    """Send these due escalations to the workers running their tasks (`agentq_kill` of
    agentq.tools.task); each order is sent by the one sweeper whose ZREM takes it. Returns
    how many were sent."""
    sent = 0
    for raw in due:
        if not r.zrem(k.KILLS, raw):
            continue  # another sweeper took it
        order = json.loads(raw)
        broadcast(app, k.KILL_COMMAND, {"targets": order["targets"]}, destination=order["to"])
        sent += 1
    return sent


def settle_pending(
    ctx: StepContext,
    history: list[dict[str, Any]],
    result_for: Callable[[ToolCall, dict[str, Any]], ToolResult],
) -> tuple[list[dict[str, Any]], list[str]]:
    """Settle each unanswered call (unless a result won already); return the round's tool
    messages, so the history stays valid however the turn ends, and the ids of the calls
    settled here (the ones a retry runs again)."""
    calls = pending_calls(history)
    if not calls:
        return [], []
    ours: list[str] = []
    _, settled, dispatched = ctx.store.round_view(ctx.turn_id, [c.id for c in calls])
    for call in calls:
        if call.id in settled:
            continue
        mine = result_for(call, dispatched.get(call.id, {}))
        # A tool's result that came first is the one kept.
        settled[call.id], won = ctx.settle(mine, tracked=call.id in dispatched)
        if won:
            ours.append(call.id)
    # A password answer is read once by its tool; a round that ends must not leave one.
    ctx.store.redis.delete(*[k.turn_key(ctx.turn_id, "secret", f"{c.id}.approval") for c in calls])
    return [settled[c.id].to_openai() for c in calls], ours
