"""Ending a round early: revoke a turn's unfinished tasks and give every call a result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.fleet.broker import revoke
from agentq.models import ToolCall, ToolResult
from agentq.orchestrator.plan import pending_calls
from agentq.orchestrator.settle import settle_call

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore


def revoke_unsettled(
    store: TurnStore, app: Celery, turn_id: str, *, kill_grace_s: float
) -> list[str]:
    """SIGTERM every unfinished task of the turn now, SIGKILL whatever is left after a grace.

    Only the workers running them are told: a task that has not started yet never
    runs, since its start sees the turn's cancel flag. Agent calls have no task: their
    child turns are aborted instead.
    """
    running = store.running_tasks(turn_id)
    if not running:
        return []
    ids = list(running)
    # A start record without a worker name (never expected) falls back to a broadcast.
    destination = sorted({str(w) for w in running.values()}) if all(running.values()) else None

    def send(signal: str) -> None:
        revoke(app, ids, terminate=True, signal=signal, destination=destination)

    send("SIGTERM")
    if kill_grace_s >= 0:
        timer = threading.Timer(kill_grace_s, send, args=("SIGKILL",))
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
    settled, dispatched = store.round_view(turn_id, [c.id for c in calls])
    lost_race = False
    for call in calls:
        if call.id in settled:
            continue
        mine = result_for(call, dispatched.get(call.id, {}))
        tracked = call.id in dispatched
        _, won = settle_call(
            store, turn_id, mine, traceparent=traceparent, tracked=tracked, read_winner=False
        )
        if won:
            settled[call.id] = mine
        else:
            lost_race = True  # a tool's result came first: it is the one kept, read below
    if lost_race:
        settled, _ = store.round_view(turn_id, [c.id for c in calls])
    # A password answer is read once by its tool; a round that ends must not leave one.
    store.redis.delete(*[k.secret_key(turn_id, f"{c.id}.approval") for c in calls])
    return [settled[c.id].to_openai() for c in calls]
