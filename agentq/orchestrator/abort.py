"""Abort: revoke a turn's unfinished tasks and leave a history where every call has a result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery import Celery

from agentq.constants import results_key
from agentq.models import ToolCall, ToolResult
from agentq.results import cancelled_result
from agentq.store import TurnStore, text


def pending_calls(history: list[dict[str, Any]]) -> list[ToolCall]:
    """The tool calls of the last assistant message that have no tool message yet."""
    for i in range(len(history) - 1, -1, -1):
        msg = history[i]
        if msg.get("role") == "assistant":
            answered = {m.get("tool_call_id") for m in history[i + 1 :] if m.get("role") == "tool"}
            return [
                ToolCall(
                    id=c["id"],
                    name=c["function"]["name"],
                    arguments=c["function"].get("arguments") or "{}",
                )
                for c in msg.get("tool_calls") or []
                if c["id"] not in answered
            ]
        if msg.get("role") == "user":
            return []
    return []


def revoke_unsettled(
    store: TurnStore, app: Celery, turn_id: str, *, kill_grace_s: float
) -> list[str]:
    """SIGTERM every unfinished task of the turn now, SIGKILL whatever is left after a grace.

    Only the workers running them are told: a task that has not started yet never
    runs, since its start sees the turn's cancel flag.
    """
    done = {text(c) for c in store.redis.hkeys(results_key(turn_id))}
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
    result_for: Callable[[ToolCall, dict[str, Any]], ToolResult],
) -> int:
    """Settle each unanswered call (unless a result won already) and append the round's
    tool messages, so the history stays valid however the turn ends."""
    calls = pending_calls(store.history(turn_id))
    if not calls:
        return 0
    _, dispatched = store.round_view(turn_id, [c.id for c in calls])
    for call in calls:
        store.settle(turn_id, result_for(call, dispatched.get(call.id, {})))
    results, _ = store.round_view(turn_id, [c.id for c in calls])
    store.append_history(turn_id, *[results[c.id].to_openai() for c in calls])
    return len(calls)


def settle_cancelled(store: TurnStore, turn_id: str, reason: str) -> int:
    """Settle each unanswered call as cancelled and append the round's tool messages."""
    return settle_pending(
        store,
        turn_id,
        lambda call, dispatch: cancelled_result(call, reason, task_id=dispatch.get("task_id")),
    )


def finalize_abort(
    store: TurnStore, app: Celery, turn_id: str, reason: str, *, kill_grace_s: float
) -> None:
    """Everything an abort does after the flag is set; run by whoever holds the turn's lease."""
    revoked = revoke_unsettled(store, app, turn_id, kill_grace_s=kill_grace_s)
    cancelled = settle_cancelled(store, turn_id, reason)
    store.close(turn_id, "aborted", abort_reason=reason)
    store.bus.publish(
        turn_id, "turn_aborted", reason=reason, revoked=len(revoked), cancelled_calls=cancelled
    )
