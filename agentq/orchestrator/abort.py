"""Ending a round early: revoke a turn's unfinished tasks and give every call a result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery import Celery

from agentq import constants as k
from agentq.models import ToolCall, ToolResult
from agentq.orchestrator.plan import pending_calls
from agentq.store import TurnStore, text
from agentq.telemetry import tracing


def revoke_unsettled(
    store: TurnStore, app: Celery, turn_id: str, *, kill_grace_s: float
) -> list[str]:
    """SIGTERM every unfinished task of the turn now, SIGKILL whatever is left after a grace.

    Only the workers running them are told: a task that has not started yet never
    runs, since its start sees the turn's cancel flag.
    """
    done = {text(c) for c in store.redis.hkeys(k.results_key(turn_id))}
    starts = store.starts(turn_id)
    running = {
        d["task_id"]: starts[cid].get("worker")
        for cid, d in store.dispatches(turn_id).items()
        if cid not in done and cid in starts
    }
    if not running:
        return []
    ids = list(running)
    # A start record without a worker name (never expected) falls back to a broadcast.
    destination = sorted({str(w) for w in running.values()}) if all(running.values()) else None

    def revoke(signal: str) -> None:
        app.control.revoke(ids, terminate=True, signal=signal, destination=destination)

    revoke("SIGTERM")
    if kill_grace_s >= 0:
        timer = threading.Timer(kill_grace_s, revoke, args=("SIGKILL",))
        timer.daemon = True
        timer.start()
    return ids


def settle_pending(
    store: TurnStore,
    turn_id: str,
    history: list[dict[str, Any]],
    result_for: Callable[[ToolCall, dict[str, Any]], ToolResult],
    traceparent: object = None,
) -> list[dict[str, Any]]:
    """Settle each unanswered call (unless a result won already); return the round's tool
    messages, so the history stays valid however the turn ends."""
    calls = pending_calls(history)
    if not calls:
        return []
    _, dispatched = store.round_view(turn_id, [c.id for c in calls])
    for call in calls:
        result = result_for(call, dispatched.get(call.id, {}))
        if store.settle(turn_id, result, wake=False) and tracing.enabled:
            tracing.record_settled(traceparent, turn_id, result)
    results, _ = store.round_view(turn_id, [c.id for c in calls])
    # A password answer is read once by its tool; a round that ends must not leave one.
    store.redis.delete(*[k.secret_key(turn_id, f"{c.id}.approval") for c in calls])
    return [results[c.id].to_openai() for c in calls]
