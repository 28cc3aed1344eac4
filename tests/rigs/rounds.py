"""Run one round of tool calls through a real turn, without a model: for tests and benchmarks.

The turn starts with the calls already asked for and ends after their round, so what is
measured or checked is the orchestrator and the tool workers, not a model.
"""

from __future__ import annotations

import secrets
import time

from agentq.config import get_settings
from agentq.events.follow import follow
from agentq.fleet.broker import send_step
from agentq.fleet.runtime import get_app, get_store
from agentq.models import AssistantMessage, ToolCall, ToolResult
from agentq.orchestrator.steps import run_step
from agentq.state.turn_state import TurnState

ROUND_ONLY = "round_only"
"""The finish reason of a turn made by :func:`start_round`."""


def start_round(calls: list[ToolCall], *, step_here: bool = False) -> str:
    """Queue a turn whose only work is this round of calls; return its id.

    With `step_here` this process takes the turn's first step, which sends the calls, as
    a stream worker sends the calls of the model round it streamed; otherwise a turn
    worker takes it.
    """
    store = get_store()
    turn_id = secrets.token_hex(16)
    history = [
        {"role": "user", "content": "run these calls"},
        AssistantMessage(tool_calls=tuple(calls)).to_openai(),
    ]
    state: TurnState = {
        "status": "queued",
        "created_at": time.time(),
        "round": 1,
        "call_count": len(calls),
        "stop_after_round": ROUND_ONLY,
    }
    store.create(turn_id, state, history)
    if step_here:
        run_step(turn_id, store=store, app=get_app(), settings=get_settings())
    else:
        send_step(get_app(), turn_id)
    return turn_id


def wait_round(turn_id: str, calls: list[ToolCall], timeout_s: float = 60.0) -> list[ToolResult]:
    """Wait for the round's turn to end; its results in call order."""
    store = get_store()
    deadline = time.monotonic() + timeout_s
    for ev in follow(store.bus, turn_id, heartbeat_s=0.5):
        if ev is not None and ev.type in ("turn_finished", "turn_aborted", "turn_error"):
            if ev.type != "turn_finished":
                raise AssertionError(f"round turn {turn_id} ended with {ev.type}: {ev.fields}")
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"round turn {turn_id} did not end within {timeout_s}s")
    results = store.results(turn_id)
    return [results[c.id] for c in calls]


def run_round(calls: list[ToolCall], timeout_s: float = 60.0) -> tuple[str, list[ToolResult]]:
    """Run one round through a real turn worker and the tool workers; (turn id, results)."""
    turn_id = start_round(calls)
    return turn_id, wait_round(turn_id, calls, timeout_s)
