"""Interaction requests (approvals, passwords, confirms): finite, answered once, deny by default."""

from __future__ import annotations

import json

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.models import InteractionAnswer, InteractionKind, InteractionRequest
from agentq.store import TurnStore, text

# Closing a request is a compare-and-set on its state, so an answer and the timeout
# can race and exactly one wins; the loser gets the state that won (409 to a client).
_CLOSE_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state ~= 'pending' then return state end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'decision', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[5])
end
if ARGV[4] ~= '' then redis.call('RPUSH', KEYS[2], ARGV[4]) end
return 'ok'
"""


def default_timeout_s(kind: InteractionKind, settings: Settings) -> float | None:
    """Default wait per kind; a device code has none, its provider must declare one."""
    return {
        "approval": settings.approval_timeout_s,
        "password": settings.password_timeout_s,
        "confirm": settings.confirm_timeout_s,
        "device_code": None,
    }[kind]


class Interactions:
    def __init__(self, store: TurnStore) -> None:
        self.store = store
        self._close = store.redis.register_script(_CLOSE_LUA)

    def open(self, turn_id: str, req: InteractionRequest) -> None:
        key = k.interaction_key(turn_id, req.request_id)
        pipe = self.store.redis.pipeline()
        pipe.hset(key, mapping={"state": "pending", "request": req.model_dump_json()})
        pipe.expire(key, self.store.ttl_s)
        pipe.execute()

    def get(self, turn_id: str, request_id: str) -> tuple[str, InteractionRequest] | None:
        raw = self.store.redis.hmget(k.interaction_key(turn_id, request_id), "state", "request")
        if raw[0] is None or raw[1] is None:
            return None
        return text(raw[0]), InteractionRequest.model_validate_json(raw[1])

    def decision(self, turn_id: str, request_id: str) -> str | None:
        raw = self.store.redis.hget(k.interaction_key(turn_id, request_id), "decision")
        return None if raw is None else text(raw)

    def answer(self, turn_id: str, request_id: str, answer: InteractionAnswer) -> None:
        """Deliver a client's answer; raises if unknown, answered already or timed out."""
        found = self.get(turn_id, request_id)
        if found is None:
            raise InteractionNotFound(turn_id, request_id)
        _, req = found
        # Only an approved password is kept (until its tool reads it once); a denied
        # call never runs, so its password would otherwise sit in Redis until expiry.
        approved = answer.decision == "approve"
        secret = answer.value if (req.kind == "password" and approved and answer.value) else ""
        msg = json.dumps(
            {
                "kind": "answer",
                "request_id": request_id,
                "decision": answer.decision,
                "has_value": bool(answer.value),
            }
            | ({} if req.kind == "password" else {"value": answer.value})
        )
        outcome = self._close(
            keys=[
                k.interaction_key(turn_id, request_id),
                k.inbox_key(turn_id),
                k.secret_key(turn_id, request_id),
            ],
            args=[
                "answered",
                answer.decision,
                secret,
                msg,
                max(1, int(req.timeout_ms / 1000) + 600),
            ],
        )
        outcome = text(outcome)
        if outcome == "missing":
            raise InteractionNotFound(turn_id, request_id)
        if outcome != "ok":
            raise InteractionClosed(turn_id, request_id, outcome)

    def expire(self, turn_id: str, request_id: str, state: str = "timed_out") -> bool:
        """Close a pending request without an answer; False if an answer won the race."""
        outcome = self._close(
            keys=[
                k.interaction_key(turn_id, request_id),
                k.inbox_key(turn_id),
                k.secret_key(turn_id, request_id),
            ],
            args=[state, "deny", "", "", 1],
        )
        return text(outcome) == "ok"
