"""Interaction requests (approvals, passwords, questions): answered once, deny by default."""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import AnswerInvalid, InteractionClosed, InteractionNotFound, MissingExtra
from agentq.events.bus import SEQ_FIELD, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import InteractionAnswer, InteractionKind, InteractionRequest
from agentq.state.base import WAKE_BACKSTOP_S, StoreBase, TurnKeys, text
from agentq.state.lua import turn_open_lua, wake_lua


class CloseArgs(NamedTuple):
    new_state: str
    """answered, defaulted, ..."""
    decision: str
    secret: str
    """A password answer ("": none), kept `secret_ttl_s` for its tool to read once."""
    secret_ttl_s: int
    event: str
    """The body of the event the close publishes."""
    log_opts: str
    turn_id: str
    wake_at: float


# _CLOSE_LUA: a compare-and-set on the request's state, so of an answer and the timeout
# exactly one wins; the loser gets the state that won (409 to a client). Only an answer
# wakes the turn: a timeout or a default is its own step's (or tool's) doing.
_CLOSE_LUA = (
    bind_lua((*TurnKeys._fields, "interaction_key", "secret_key"), CloseArgs)
    + f"""
local state = redis.call('HGET', interaction_key, 'state')
if not state then return 'missing' end
if state ~= 'pending' then return state end
{turn_open_lua("'closed'")}
redis.call('HSET', interaction_key, 'state', new_state, 'decision', decision)
if secret ~= '' then
  redis.call('SET', secret_key, secret, 'EX', secret_ttl_s)
end
{publish_lua("log_key", "channel", "event", "log_opts", "watched")}
if new_state == 'answered' then
{wake_lua(f"'{SEQ_FIELD}', seq")}else
  redis.call('HSET', turn_key, '{SEQ_FIELD}', seq)
end
return 'ok'
"""
)


def default_timeout_s(kind: InteractionKind, settings: Settings) -> float | None:
    """Default wait per kind; a device code has none, its provider must declare one."""
    return None if kind == "device_code" else float(getattr(settings, f"{kind}_timeout_s"))


def checked_answer(turn_id: str, req: InteractionRequest, value: str | None) -> str:
    """An `input` answer (JSON, else plain text) as JSON, once it meets the request's schema."""
    raw = value or ""
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = raw  # free text needs no quotes
    if req.answer_schema is not None:
        try:
            import jsonschema
        except ImportError:
            raise MissingExtra("mcp", "jsonschema", "checking an input answer") from None
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(req.answer_schema).iter_errors(answer)
        )
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "answer"
            why = f"the answer does not fit its schema: {where}: {error.message}"
            raise AnswerInvalid(turn_id, req.request_id, why)
    return json.dumps(answer, ensure_ascii=False)


class InteractionRecords(StoreBase):
    """A turn's interaction requests: opened, read, answered once or expired."""

    _interaction_close = LuaScript(_CLOSE_LUA)

    def open_interaction(self, turn_id: str, req: InteractionRequest) -> None:
        key = k.turn_key(turn_id, "interaction", req.request_id)
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping={"state": "pending", "request": req.model_dump_json()})
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def interaction(self, turn_id: str, request_id: str) -> tuple[str, InteractionRequest] | None:
        raw = self.redis.hmget(k.turn_key(turn_id, "interaction", request_id), "state", "request")
        if raw[0] is None or raw[1] is None:
            return None
        return text(raw[0]), InteractionRequest.model_validate_json(raw[1])

    def interaction_decision(self, turn_id: str, request_id: str) -> str | None:
        raw = self.redis.hget(k.turn_key(turn_id, "interaction", request_id), "decision")
        return None if raw is None else text(raw)

    def answer_interaction(self, turn_id: str, request_id: str, answer: InteractionAnswer) -> None:
        """Deliver a client's answer and wake the turn; raises if unknown, answered or timed out."""
        found = self.interaction(turn_id, request_id)
        if found is None:
            raise InteractionNotFound(turn_id, request_id)
        _, req = found
        # Only an approved password is kept (its tool reads it once): a denied call never runs.
        approved = answer.decision == "approve"
        secret = answer.value if (req.kind == "password" and approved and answer.value) else ""
        if req.kind == "input" and approved:
            # Refused before anything is written: the question stays open.
            secret = checked_answer(turn_id, req, answer.value)
        fields = {"request_id": request_id, "decision": answer.decision, "by": "user"}
        event = event_body(turn_id, "interaction_answered", fields)
        ttl_s = max(1, int(req.timeout_ms / 1000) + 600)
        outcome = self._close_interaction(
            turn_id, request_id, "answered", answer.decision, secret, ttl_s, event
        )
        if outcome == "missing":
            raise InteractionNotFound(turn_id, request_id)
        if outcome != "ok":
            raise InteractionClosed(turn_id, request_id, outcome)
        self.send_step(turn_id)

    def expire_interaction(
        self, turn_id: str, req: InteractionRequest, state: str = "timed_out"
    ) -> str:
        """Close a pending request unanswered (`defaulted`: a headless default), its turn not
        woken; its state now: `state`, or an answer's that won ("closed": the turn ended)."""
        rid = req.request_id
        fields: dict[str, Any] = {"request_id": rid, "decision": req.default, "by": "default"}
        if state != "defaulted":
            fields = {"request_id": rid, "call_id": req.call_id, "timeout_ms": req.timeout_ms}
        kind = "interaction_answered" if state == "defaulted" else "interaction_timed_out"
        event = event_body(turn_id, kind, fields)
        got = self._close_interaction(turn_id, rid, state, "deny", "", 1, event)
        return state if got == "ok" else got

    def _close_interaction(self, turn_id: str, request_id: str, *close: Any) -> str:
        """_CLOSE_LUA, given the first five of its CloseArgs (`close`)."""
        own = (k.turn_key(turn_id, p, request_id) for p in ("interaction", "secret"))
        keys = [*TurnKeys.of(turn_id), *own]
        log_opts, wake_at = self.bus.log_arg(), time.time() + WAKE_BACKSTOP_S
        args = CloseArgs._make((*close, log_opts, turn_id, wake_at))
        return text(self._interaction_close(keys=keys, args=list(args)))
