"""One turn in time: each model round and call as a bar, from its event log and records."""

from __future__ import annotations

import time
from itertools import islice
from typing import TYPE_CHECKING, Any

from agentq.events import Event
from agentq.models import TERMINAL_STATUSES
from agentq.state.turn_state import TurnState

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

MAX_LOG_EVENTS = 20_000
"""The log is capped (`event_log_maxlen`) anyway; this bounds one read of it."""
LOG_TAIL = 300
"""Events handed out with the timeline (deltas excluded): the newest ones."""
QUIET_TYPES = frozenset({"llm_delta", "tool_progress"})
# Fields that carry text the log line does not need (the model's output, arguments).
_DROP_FIELDS = frozenset({"text", "arguments", "content", "usage"})


def model_rounds(events: list[Event], ended_at: float | None) -> list[dict[str, Any]]:
    """Model rounds from llm_started / llm_finished; an unfinished one ends with the turn."""
    rounds: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for ev in events:
        if ev.type == "llm_started":
            if current is not None:
                current.update(finished_at=ev.ts, status="lost")
            current = {
                "round": len(rounds) + 1,
                "started_at": ev.ts,
                "finished_at": None,
                "status": "running",
                "retries": 0,
                # How long the round waited for model capacity before it was sent.
                "queued_ms": ev.fields.get("queued_ms"),
                "model": ev.fields.get("model"),
            }
            rounds.append(current)
        elif ev.type == "llm_retry" and current is not None:
            current["retries"] += 1
        elif ev.type == "llm_finished" and current is not None:
            current.update({n: ev.fields.get(n) for n in ("error", "code", "tool_calls")})
            current.update(finished_at=ev.ts, status="error" if current["error"] else "ok")
            current = None
    if current is not None and ended_at is not None:
        current.update(finished_at=ended_at, status="cancelled")
    return rounds


def call_rounds(history: list[dict[str, Any]], start: int) -> dict[str, int]:
    """call id -> the model round (1-based) that asked for it."""
    asked = [m for m in history[start:] if m.get("role") == "assistant"]
    return {
        str(call["id"]): n
        for n, msg in enumerate(asked, 1)
        for call in msg.get("tool_calls") or []
        if isinstance(call, dict) and call.get("id")
    }


def calls(
    dispatched: dict[str, dict[str, Any]],
    starts: dict[str, dict[str, Any]],
    results: dict[str, dict[str, Any]],
    rounds_of: dict[str, int],
) -> list[dict[str, Any]]:
    """Every call of the turn with its bar, limits and outcome, in the order they were sent."""
    ids = list(dispatched) + [c for c in results if c not in dispatched]
    out = []
    for cid in ids:
        d, s, r = dispatched.get(cid, {}), starts.get(cid, {}), results.get(cid) or {}
        rec = r.get("record") or {}
        status = str(r["status"]) if r else ("running" if s else "queued")
        out.append(
            {
                "call_id": cid,
                "tool": d.get("tool") or r.get("tool"),
                "round": rounds_of.get(cid),
                "status": status,
                "dispatched_at": d.get("dispatched_at"),
                **{f: rec.get(f) or s.get(f) for f in ("started_at", "worker", "pid")},
                **{f: rec.get(f) for f in ("finished_at", "duration_ms")},
                **{f: d.get(f, rec.get(f)) for f in ("timeout_s", "budget_s")},
                "soft_timeout_s": d.get("soft_timeout_s"),
                **{f: bool(rec.get(f)) for f in ("overran", "soft_limited", "partial")},
                "task_id": rec.get("task_id") or d.get("task_id"),
                "queue": d.get("queue"),
                **{f: r.get(f) for f in ("error", "reason")},
            }
        )
    return out


def log_line(ev: Event) -> dict[str, Any]:
    fields = {k: v for k, v in ev.fields.items() if k not in _DROP_FIELDS}
    return {"seq": ev.seq, "ts": ev.ts, "type": ev.type, "fields": fields}


def timeline(store: TurnStore, turn_id: str, state: TurnState) -> dict[str, Any]:
    """The turn's rounds, calls and recent events; `state` is its state hash, read already."""
    log = (e for e in store.bus.log(turn_id) if e.type != "llm_delta")
    events = list(islice(log, MAX_LOG_EVENTS))
    ended_at = state.get("ended_at")
    results = {c: r.model_dump() for c, r in store.results(turn_id).items()}
    rounds_of = call_rounds(store.history(turn_id), int(state.get("history_start") or 0))
    starts, dispatched, _ = store.call_progress(turn_id)
    bars = calls(dispatched, starts, results, rounds_of)
    if state.get("status") in TERMINAL_STATUSES:
        # A call the turn ended with and that never settled (it should not happen) ends here.
        for c in bars:
            if c["status"] in ("running", "queued") and c["finished_at"] is None:
                c["finished_at"] = ended_at
    shown = [e for e in events if e.type not in QUIET_TYPES][-LOG_TAIL:]
    return {
        "turn_id": turn_id,
        "now": time.time(),
        **{f: state.get(f) for f in ("created_at", "started_at", "ended_at")},
        "rounds": model_rounds(events, ended_at),
        "calls": bars,
        "events": [log_line(e) for e in shown],
    }
