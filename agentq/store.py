"""Durable turn state in Redis: state, history, results by call id, the inbox, the lease."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from agentq import constants as k
from agentq.events.bus import EventBus, event_body, publish_lua
from agentq.models import ToolResult

# Settle = store the result under its call id (first writer wins), wake the turn and
# publish tool_finished, in one atomic step: exactly one result per call, whoever
# settles it (the tool, the worker's parent on a hard kill, or the turn on abort/loss).
# A turn that is over (or whose state Redis lost) takes no more results: nothing is
# written after its terminal event, and nothing recreates half of a vanished turn.
_TURN_OPEN_LUA = """
local status = redis.call('HGET', KEYS[%d], 'status')
if not status or status == '"finished"' or status == '"aborted"' or status == '"error"' then
  return %d
end
"""

_SETTLE_LUA = (
    _TURN_OPEN_LUA % (6, 0)
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[3])
"""
    + publish_lua("KEYS[3]", "KEYS[4]", "KEYS[5]", "ARGV[4]", "ARGV[5]")
    + "return 1"
)

# A task that starts checks, in the same step that records its start, that its call
# is not settled yet (a redelivery) and its turn not cancelled. The start record names
# the delivery (task id and retry count): the broker handing the same delivery out
# again while it runs (a restored unacked message) must not run the call twice.
_START_LUA = (
    """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
"""
    + _TURN_OPEN_LUA % (7, -2)
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local prev = redis.call('HGET', KEYS[2], ARGV[1])
if prev and ARGV[5] ~= '' then
  local ok, rec = pcall(cjson.decode, prev)
  if ok and rec['delivery'] == ARGV[5] then return 2 end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
"""
    + publish_lua("KEYS[4]", "KEYS[5]", "KEYS[6]", "ARGV[3]", "ARGV[4]")
    + "return 1"
)

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def text(v: Any) -> str:
    """Redis answers bytes; callers want str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _loads(v: bytes | str | None) -> Any:
    return None if v is None else json.loads(v)


class TurnStore:
    def __init__(self, client: redis.Redis, *, log_maxlen: int = 10_000, ttl_s: int = 604800):
        self.redis = client
        self.bus = EventBus(client, log_maxlen=log_maxlen)
        self.ttl_s = ttl_s
        self._settle = client.register_script(_SETTLE_LUA)
        self._start = client.register_script(_START_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    # -- state ---------------------------------------------------------------

    def create(self, turn_id: str, state: dict[str, Any], history: list[dict[str, Any]]) -> None:
        pipe = self.redis.pipeline()
        pipe.hset(k.turn_key(turn_id), mapping={f: json.dumps(v) for f, v in state.items()})
        if history:
            pipe.rpush(k.history_key(turn_id), *[json.dumps(m) for m in history])
        pipe.zadd(k.ACTIVE_TURNS, {turn_id: time.time()})
        parent = state.get("parent_turn_id")
        if parent:
            pipe.sadd(k.children_key(parent), turn_id)
        pipe.execute()

    def state(self, turn_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(k.turn_key(turn_id))
        if not raw:
            return None
        return {text(f): json.loads(v) for f, v in raw.items()}

    def update(self, turn_id: str, **fields: Any) -> None:
        self.redis.hset(k.turn_key(turn_id), mapping={f: json.dumps(v) for f, v in fields.items()})

    def status(self, turn_id: str) -> str | None:
        return _loads(self.redis.hget(k.turn_key(turn_id), "status"))  # type: ignore[no-any-return]

    def active(self) -> list[str]:
        return [text(t) for t in self.redis.zrange(k.ACTIVE_TURNS, 0, -1)]

    def close(self, turn_id: str, status: str, **fields: Any) -> None:
        """Mark the turn ended and give its keys the retention TTL."""
        pipe = self.redis.pipeline()
        pipe.hset(
            k.turn_key(turn_id),
            mapping={f: json.dumps(v) for f, v in {"status": status, **fields}.items()},
        )
        pipe.zrem(k.ACTIVE_TURNS, turn_id)
        for key in k.turn_keys(turn_id):
            pipe.expire(key, self.ttl_s)
        pipe.execute()

    # -- history ---------------------------------------------------------------

    def history(self, turn_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(k.history_key(turn_id), 0, -1)]

    def append_history(self, turn_id: str, *messages: dict[str, Any]) -> None:
        if messages:
            self.redis.rpush(k.history_key(turn_id), *[json.dumps(m) for m in messages])

    # -- calls and results -------------------------------------------------------

    def record_dispatch(self, turn_id: str, records: dict[str, dict[str, Any]]) -> None:
        if records:
            self.redis.hset(
                k.calls_key(turn_id), mapping={c: json.dumps(r) for c, r in records.items()}
            )

    def dispatches(self, turn_id: str) -> dict[str, dict[str, Any]]:
        raw = self.redis.hgetall(k.calls_key(turn_id))
        return {text(c): json.loads(v) for c, v in raw.items()}

    def starts(self, turn_id: str) -> dict[str, dict[str, Any]]:
        raw = self.redis.hgetall(k.started_key(turn_id))
        return {text(c): json.loads(v) for c, v in raw.items()}

    def mark_started(
        self, turn_id: str, call_id: str, start: dict[str, Any], event: dict[str, Any]
    ) -> int:
        """Record a task's start; 1 started, 0 already settled, -1 turn cancelled,
        -2 turn over or gone, 2 this delivery (`start["delivery"]`) started already."""
        return int(
            self._start(
                keys=[
                    k.results_key(turn_id),
                    k.started_key(turn_id),
                    k.cancel_key(turn_id),
                    k.seq_key(turn_id),
                    k.log_key(turn_id),
                    k.events_channel(turn_id),
                    k.turn_key(turn_id),
                ],
                args=[
                    call_id,
                    json.dumps(start),
                    event_body(turn_id, "tool_started", event),
                    self.bus.log_maxlen,
                    str(start.get("delivery") or ""),
                ],
            )
        )

    def workers_alive(self, hostnames: list[str]) -> dict[str, bool]:
        """Which tool workers sent a heartbeat lately."""
        if not hostnames:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for h in hostnames:
            pipe.exists(k.worker_alive_key(h))
        return {h: bool(v) for h, v in zip(hostnames, pipe.execute(), strict=True)}

    def settle(self, turn_id: str, result: ToolResult) -> bool:
        """Store a call's result unless one is stored already; True if this one won."""
        result_json = result.model_dump_json()
        rec = result.record
        event = {
            "call_id": result.call_id,
            "tool": result.tool,
            "status": result.status,
            "duration_ms": rec.duration_ms,
            "overran": rec.overran,
            "soft_limited": rec.soft_limited,
            "partial": rec.partial,
            "worker": rec.worker,
            "error": result.error,
            "reason": result.reason,
            "truncated_bytes": result.truncated_bytes,
        }
        inbox_msg = (
            f'{{"kind":"result","call_id":{json.dumps(result.call_id)},"result":{result_json}}}'
        )
        won = self._settle(
            keys=[
                k.results_key(turn_id),
                k.inbox_key(turn_id),
                k.seq_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
                k.turn_key(turn_id),
            ],
            args=[
                result.call_id,
                result_json,
                inbox_msg,
                event_body(turn_id, "tool_finished", event),
                self.bus.log_maxlen,
            ],
        )
        return bool(won)

    def round_view(
        self, turn_id: str, call_ids: list[str]
    ) -> tuple[dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """Settled results and dispatch records of these calls, in one round trip."""
        if not call_ids:
            return {}, {}
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(k.results_key(turn_id), call_ids)
        pipe.hmget(k.calls_key(turn_id), call_ids)
        results, calls = pipe.execute()
        return (
            {
                c: ToolResult.model_validate_json(r)
                for c, r in zip(call_ids, results, strict=True)
                if r
            },
            {c: json.loads(d) for c, d in zip(call_ids, calls, strict=True) if d},
        )

    def result(self, turn_id: str, call_id: str) -> ToolResult | None:
        raw = self.redis.hget(k.results_key(turn_id), call_id)
        return None if raw is None else ToolResult.model_validate_json(raw)

    def results(self, turn_id: str) -> dict[str, ToolResult]:
        raw = self.redis.hgetall(k.results_key(turn_id))
        return {text(c): ToolResult.model_validate_json(v) for c, v in raw.items()}

    # -- inbox ----------------------------------------------------------------------

    def push(self, turn_id: str, msg: dict[str, Any]) -> None:
        self.redis.rpush(k.inbox_key(turn_id), json.dumps(msg))

    def pop(self, turn_id: str, timeout_s: float) -> dict[str, Any] | None:
        """Wait for the next inbox message; None when `timeout_s` passes first."""
        if timeout_s <= 0:
            raw = self.redis.lpop(k.inbox_key(turn_id))
            return None if raw is None else json.loads(raw)  # type: ignore[arg-type]
        item = self.redis.blpop([k.inbox_key(turn_id)], timeout=max(timeout_s, 0.01))
        return None if item is None else json.loads(item[1])

    # -- cancel ---------------------------------------------------------------------------

    def request_cancel(self, turn_id: str, reason: str) -> bool:
        """Set the cancel flag; False if it was set already."""
        first = self.redis.set(k.cancel_key(turn_id), reason, nx=True, ex=self.ttl_s)
        return bool(first)

    def cancel_reason(self, turn_id: str) -> str | None:
        v = self.redis.get(k.cancel_key(turn_id))
        return None if v is None else text(v)  # type: ignore[union-attr]

    def children(self, turn_id: str) -> list[str]:
        return [text(c) for c in self.redis.smembers(k.children_key(turn_id))]

    # -- lease -------------------------------------------------------------------------

    def acquire_lease(self, turn_id: str, holder: str, ttl_s: float) -> bool:
        return bool(self.redis.set(k.lease_key(turn_id), holder, nx=True, px=int(ttl_s * 1000)))

    def renew_lease(self, turn_id: str, holder: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[k.lease_key(turn_id)], args=[holder, int(ttl_s * 1000)]))

    def renew_leases(self, held: dict[str, str], ttl_s: float) -> dict[str, bool]:
        """Renew many leases (turn id -> holder) in one round trip; turn id -> still held."""
        pipe = self.redis.pipeline(transaction=False)
        for turn_id, holder in held.items():
            self._renew(keys=[k.lease_key(turn_id)], args=[holder, int(ttl_s * 1000)], client=pipe)
        return {t: bool(r) for t, r in zip(held, pipe.execute(), strict=True)}

    def release_lease(self, turn_id: str, holder: str) -> None:
        self._release(keys=[k.lease_key(turn_id)], args=[holder])

    def lease_holder(self, turn_id: str) -> str | None:
        v = self.redis.get(k.lease_key(turn_id))
        return None if v is None else text(v)  # type: ignore[union-attr]
