"""MCP elicitation: a server's `elicitation/create` during a call becomes an `input`
question on the turn of the one call its session has in flight (an elicitation names no
call), and the answer goes back; docs/mcp.md says what the server hears in each case.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.config import get_settings
from agentq.models import InteractionRequest
from agentq.state.interactions import Interactions

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.mcp")

POLL_S = 0.25
"""How often a pending question's record is read while the server waits for it."""
_seq = itertools.count(1)


@dataclass(frozen=True)
class Caller:
    """A call in flight on a server's session: whose question an elicitation is."""

    store: TurnStore
    turn_id: str
    call_id: str
    tool: str
    deadline: float | None
    """Epoch seconds of the call's hard limit; None: none."""


def ask(caller: Caller, message: str, schema: Any) -> tuple[str, Any]:
    """Ask the question on the caller's turn and wait for it (blocking: run it in a
    thread); (`accept`, content), (`decline`, None) or (`cancel`, None)."""
    store = caller.store
    state = store.state(caller.turn_id) or {}
    if state.get("headless") or state.get("status") not in ("running", "queued"):
        return "decline", None
    left_s = None if caller.deadline is None else caller.deadline - time.time()
    timeout_s = get_settings().input_timeout_s
    timeout_s = timeout_s if left_s is None else max(0.001, min(timeout_s, left_s - 1))
    req = InteractionRequest(
        request_id=f"{caller.call_id}.e{next(_seq)}.approval",
        kind="input",
        call_id=caller.call_id,
        tool=caller.tool,
        prompt=message,
        timeout_ms=max(1, int(timeout_s * 1000)),
        answer_schema=schema if isinstance(schema, dict) else None,
    )
    interactions = Interactions(store)
    interactions.open(caller.turn_id, req)
    store.bus.publish(caller.turn_id, "interaction_requested", **req.model_dump(), source="mcp")
    rid, until = req.request_id, req.created_at + timeout_s
    while True:
        found = interactions.get(caller.turn_id, rid)
        if found is None or found[0] != "pending":
            break
        if time.time() >= until:
            if interactions.expire(caller.turn_id, rid):
                store.bus.publish(
                    caller.turn_id,
                    "interaction_timed_out",
                    request_id=rid,
                    call_id=caller.call_id,
                    timeout_ms=req.timeout_ms,
                )
                return "cancel", None
            continue
        time.sleep(POLL_S)
    if interactions.decision(caller.turn_id, rid) != "approve":
        return "decline", None
    raw = store.redis.getdel(k.secret_key(caller.turn_id, rid))
    return "accept", json.loads(raw) if raw is not None else {}


async def on_elicit(server: str, callers: dict[int, Caller], params: Any) -> Any:
    """The session's elicitation callback: the ElicitResult of the question it asks."""
    from mcp import types

    message = str(getattr(params, "message", ""))
    schema: Any = getattr(params, "requested_schema", None)
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(by_alias=True, exclude_none=True)
    if getattr(params, "mode", "form") != "form" or len(callers) != 1:
        log.info(
            "MCP server %s: elicitation declined (%s)",
            server,
            "not a form" if len(callers) == 1 else f"{len(callers)} calls in flight",
        )
        return types.ElicitResult(action="decline")
    (caller,) = callers.values()
    action, content = await asyncio.to_thread(ask, caller, message, schema)
    if action == "accept" and isinstance(content, dict):
        return types.ElicitResult(action="accept", content=content)
    return types.ElicitResult(action="cancel" if action == "cancel" else "decline")
