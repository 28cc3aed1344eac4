"""Abort: revoke a turn's unfinished tasks and leave a history where every call has a result."""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery

from agentq.constants import results_key
from agentq.models import ToolCall
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
    workers = sorted({w for w in running.values() if w})
    destination = workers if len(workers) == len(set(running.values())) else None

    def revoke(signal: str) -> None:
        app.control.revoke(ids, terminate=True, signal=signal, destination=destination)

    revoke("SIGTERM")
    if kill_grace_s >= 0:
        timer = threading.Timer(kill_grace_s, revoke, args=("SIGKILL",))
        timer.daemon = True
        timer.start()
    return ids


def settle_cancelled(store: TurnStore, turn_id: str, reason: str) -> int:
    """Settle each unanswered call as cancelled and append the round's tool messages."""
    history = store.history(turn_id)
    calls = pending_calls(history)
    if not calls:
        return 0
    dispatched = store.dispatches(turn_id)
    for call in calls:
        d = dispatched.get(call.id, {})
        store.settle(turn_id, cancelled_result(call, reason, task_id=d.get("task_id")))
    results = store.results(turn_id)
    store.append_history(turn_id, *[results[c.id].to_openai() for c in calls])
    return len(calls)


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
