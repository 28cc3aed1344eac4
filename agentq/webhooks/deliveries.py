"""Deliveries in Redis, kept until accepted, gone or failed for good: whoever sends an
attempt's message first pushes its due score a lease ahead, so a lost one is sent again."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from agentq import constants as k
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import final_content
from agentq.state.base import text

if TYPE_CHECKING:
    import redis

    from agentq.config import Settings
    from agentq.state.store import TurnStore

Status = Literal["pending", "delivered", "gone", "failed"]
EVENT_TYPES = {"finished": "turn.finished", "error": "turn.failed", "aborted": "turn.aborted"}
MAX_ATTEMPTS_KEPT = 50
"""The newest attempts kept per delivery, for `agentq show` and the console."""


class Delivery(BaseModel):
    """One delivery as stored (never with the secret or a signature)."""

    id: str
    turn_id: str
    url: str
    status: Status = "pending"
    attempts: int = 0
    created_at: float
    next_at: float | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    ended_at: float | None = None
    body: str | None = Field(default=None, exclude=True)
    """What every attempt sends (fixed by the first, or when an event's delivery is made)."""


class AttemptRecord(BaseModel):
    n: int
    at: float
    status_code: int | None
    error: str | None
    duration_ms: int


class CreateKeys(NamedTuple):
    delivery_key: str
    due_key: str
    index_key: str
    counts_key: str


class CreateArgs(NamedTuple):
    delivery_id: str
    turn_id: str
    url: str
    now: float
    due_at: float
    """A lease from now: the creator sends the first attempt's message itself."""
    body: str
    """Fixed now (an event's delivery); "": the first attempt builds it (the turn's end)."""


# CREATE_LUA: creating a delivery, once (a second call: no-op).
CREATE_LUA = (
    bind_lua(CreateKeys, CreateArgs)
    + """
if redis.call('EXISTS', delivery_key) == 1 then return 0 end
redis.call('HSET', delivery_key, 'id', delivery_id, 'turn_id', turn_id, 'url', url,
  'status', 'pending', 'attempts', 0, 'created_at', now, 'next_at', now)
redis.call('ZADD', due_key, due_at, delivery_id)
redis.call('ZADD', index_key, now, delivery_id)
if body ~= '' then redis.call('HSET', delivery_key, 'body', body) end
redis.call('HINCRBY', counts_key, 'deliveries:created', 1)
return 1
"""
)


class ClaimArgs(NamedTuple):
    now: float
    lease_until: float
    limit: int
    key_prefix: str


# CLAIM_LUA: taking due deliveries, each one's score a lease ahead, so two sweepers never
# send the same attempt at once; returns id, attempts pairs.
CLAIM_LUA = (
    bind_lua(("due_key",), ClaimArgs)
    + """
local ids = redis.call('ZRANGEBYSCORE', due_key, '-inf', now, 'LIMIT', 0, limit)
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZADD', due_key, lease_until, id)
  local attempts = redis.call('HGET', key_prefix .. id, 'attempts')
  if attempts then
    out[#out + 1] = id
    out[#out + 1] = attempts
  else
    redis.call('ZREM', due_key, id)
  end
end
return out
"""
)


class Deliveries:
    _create = LuaScript(CREATE_LUA)
    _claim = LuaScript(CLAIM_LUA)

    def __init__(self, redis: redis.Redis, settings: Settings) -> None:
        self.redis = redis
        self.retention_s = settings.turn_retention_s

    def create(
        self,
        turn_id: str,
        url: str,
        *,
        lease_s: float,
        event: tuple[str, bytes] | None = None,
    ) -> str | None:
        """Queue the turn's delivery; its id if this call created it (send its first attempt
        now). `event`: (id, body) of a running turn's event's delivery instead."""
        delivery_id = k.webhook_id(turn_id) if event is None else event[0]
        now = time.time()
        keys = CreateKeys(
            k.webhook_key(delivery_id), k.WEBHOOKS_DUE, k.WEBHOOKS_INDEX, k.WEBHOOK_COUNTS
        )
        body = "" if event is None else event[1].decode()
        args = CreateArgs(delivery_id, turn_id, url, now, now + lease_s, body)
        created = self._create(keys=list(keys), args=list(args))
        return delivery_id if created else None

    def claim_due(self, *, lease_s: float, limit: int = 100) -> list[tuple[str, int]]:
        """Due deliveries (id, attempts made), each pushed a lease ahead."""
        now = time.time()
        args = ClaimArgs(now, now + lease_s, limit, k.webhook_key(""))
        raw = self._claim(keys=[k.WEBHOOKS_DUE], args=list(args))
        return [(text(raw[i]), int(raw[i + 1])) for i in range(0, len(raw), 2)]

    def get(self, delivery_id: str) -> Delivery | None:
        raw = {text(f): text(v) for f, v in self.redis.hgetall(k.webhook_key(delivery_id)).items()}
        return Delivery.model_validate({f: v for f, v in raw.items() if v != ""}) if raw else None

    def set_body(self, delivery_id: str, body: bytes) -> bytes:
        """Fix the body the first attempt built; every retry sends the same bytes."""
        pipe = self.redis.pipeline()
        pipe.hsetnx(k.webhook_key(delivery_id), "body", body)
        pipe.hget(k.webhook_key(delivery_id), "body")
        return bytes(pipe.execute()[1])

    def record(
        self,
        delivery: Delivery,
        attempt: AttemptRecord,
        status: Status,
        next_at: float | None,
    ) -> None:
        """The attempt, its outcome and the next attempt's time (or the end), in one write."""
        key = k.webhook_key(delivery.id)
        attempts_key = k.webhook_key(delivery.id, "attempts")
        fields = {
            "attempts": str(attempt.n),
            "status": status,
            "next_at": "" if next_at is None else repr(next_at),
            "last_status_code": "" if attempt.status_code is None else str(attempt.status_code),
            "last_error": attempt.error or "",
        }
        pipe: Any = self.redis.pipeline()
        pipe.hset(key, mapping=fields)
        pipe.rpush(attempts_key, attempt.model_dump_json())
        pipe.ltrim(attempts_key, -MAX_ATTEMPTS_KEPT, -1)
        pipe.hincrby(k.WEBHOOK_COUNTS, f"attempts:{_label(status, attempt.error)}", 1)
        if next_at is None:
            pipe.hset(key, "ended_at", time.time())
            pipe.zrem(k.WEBHOOKS_DUE, delivery.id)
            pipe.hincrby(k.WEBHOOK_COUNTS, f"deliveries:{status}", 1)
            pipe.expire(key, self.retention_s)
            pipe.expire(attempts_key, self.retention_s)
        else:
            pipe.zadd(k.WEBHOOKS_DUE, {delivery.id: next_at})
        pipe.execute()

    def recent(self, limit: int = 50) -> list[Delivery]:
        ids = [text(i) for i in self.redis.zrevrange(k.WEBHOOKS_INDEX, 0, limit - 1)]
        got = {i: self.get(i) for i in ids}
        if expired := [i for i, d in got.items() if d is None]:
            self.redis.zrem(k.WEBHOOKS_INDEX, *expired)
        return [d for d in got.values() if d is not None]

    def of_turn(self, turn_id: str) -> dict[str, Any] | None:
        d = self.get(k.webhook_id(turn_id))
        if d is None:
            return None
        tries = self.redis.lrange(k.webhook_key(d.id, "attempts"), 0, -1)
        return {**d.model_dump(), "tries": [json.loads(a) for a in tries]}

    def counts(self) -> dict[str, int]:
        return {text(f): int(v) for f, v in self.redis.hgetall(k.WEBHOOK_COUNTS).items()}

    def backlog(self) -> int:
        return int(self.redis.zcard(k.WEBHOOKS_DUE))


def _label(status: Status, error: str | None) -> str:
    """An attempt's metric label: ok, http_500, refused, timed_out or unreachable."""
    word = "ok" if status == "delivered" else (error or "").lower()
    if word.startswith("http "):
        # The code alone: a 3xx's error goes on to say that redirects are not followed.
        return "http_" + word.split()[1]
    for known in ("ok", "refused", "timed out"):
        if word.startswith(known):
            return known.replace(" ", "_")
    return "unreachable"


def turn_payload(store: TurnStore, turn_id: str) -> dict[str, Any] | None:
    """The webhook body of an ended turn (None: it is gone or has not ended)."""
    state = store.state(turn_id)
    if state is None or state.get("status") not in EVENT_TYPES:
        return None
    status = str(state["status"])
    history = store.history(turn_id)
    counted = [f"{k}_tokens" for k in ("prompt", "completion", "total", "cached", "reasoning")]
    usage: dict[str, Any] = dict.fromkeys([*counted, "rounds"], 0)
    for ev in store.bus.log(turn_id):
        if ev.type == "llm_finished":
            usage["rounds"] += 1
            used = ev.fields.get("usage")
            if isinstance(used, dict):
                for name in counted:
                    usage[name] += int(used.get(name) or 0)
    if state.get("spent_usd"):
        # Its own rounds', as its state totals them (docs/spend.md).
        usage["cost_usd"] = round(float(state["spent_usd"]), 6)
    ended_at = float(state.get("ended_at") or time.time())
    data: dict[str, Any] = {
        "turn_id": turn_id,
        "status": status,
        "agent": state.get("agent"),
        "output_text": final_content(history),
        "usage": usage,
        "created_at": state.get("created_at"),
        "started_at": state.get("started_at"),
        "ended_at": ended_at,
    }
    for field in ("error", "error_code", "abort_reason", "finish_reason", "schedule"):
        if state.get(field) is not None:
            data[field] = state[field]
    return envelope(EVENT_TYPES[status], ended_at, data)


def envelope(type_: str, at: float, data: dict[str, Any]) -> dict[str, Any]:
    """A webhook's body as Standard Webhooks has it: its type, its time and its data."""
    when = datetime.fromtimestamp(at, timezone.utc).isoformat()
    return {"type": type_, "timestamp": when, "data": data}


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
