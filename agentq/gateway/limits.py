"""Per-caller limits on starting turns, kept in Redis so every gateway shares them.

A caller (a key's name, or ``addr:<ip>`` without keys) gets a token bucket of
`start_burst` starts refilled at `start_rate_per_s`, and at most
`max_active_turns_per_key` running turns. Both checks are one Lua script each, so a
flood of concurrent starts cannot slip past them between a read and a write.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from typing import NamedTuple

import redis

from agentq import constants as k
from agentq.errors import RateLimited
from agentq.events.lua_args import argv_of, bind_lua
from agentq.models import TERMINAL_STATUSES
from agentq.state.base import text


class BucketArgs(NamedTuple):
    rate_per_s: float
    burst: int


# _BUCKET_LUA: the caller's start-rate bucket, on Redis's own clock (gateways may disagree
# on time). Returns 0 when a start is allowed, else the milliseconds until one is.
_BUCKET_LUA = (
    bind_lua(("bucket_key",), BucketArgs)
    + """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) + tonumber(now_t[2]) / 1000000
local rate = tonumber(rate_per_s)
local burst = tonumber(burst)
local state = redis.call('HMGET', bucket_key, 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait_ms = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', bucket_key, 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', bucket_key, math.ceil(burst / rate) + 1)
return wait_ms
"""
)


class ReserveArgs(NamedTuple):
    max_active: int
    reservation: str
    stale_s: int
    """A reservation older than this is dropped (its start never completed)."""


# _RESERVE_LUA: the caller's set of turns (turn id or a reservation, scored by time),
# ARGV after the named ones the turns found ended: drops those and stale reservations,
# then reserves a slot if one is free: 1, else 0. The turns' states are read before,
# outside the script: on a Cluster they live on other slots than the caller's set.
_RESERVE_LUA = (
    bind_lua(("turns_key",), ReserveArgs, rest="ended")
    + """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) + tonumber(now_t[2]) / 1000000
if #ARGV >= ended_at then redis.call('ZREM', turns_key, unpack(ARGV, ended_at)) end
local members = redis.call('ZRANGE', turns_key, 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  local m = members[i]
  if string.sub(m, 1, 2) == 'r:' and tonumber(members[i + 1]) < now - tonumber(stale_s) then
    redis.call('ZREM', turns_key, m)
  end
end
if redis.call('ZCARD', turns_key) >= tonumber(max_active) then return 0 end
redis.call('ZADD', turns_key, now, reservation)
redis.call('EXPIRE', turns_key, 7 * 24 * 3600)
return 1
"""
)

RESERVATION_TTL_S = 60
"""A reservation whose start never completed (a crashed gateway) frees its slot after this."""
ACTIVE_RETRY_AFTER_S = 1.0


class StartLimits:
    """The two limits on starting turns, for one gateway."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        rate_per_s: float,
        burst: int,
        max_active: int,
    ) -> None:
        self.redis = client
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_active = max_active
        self._bucket = client.register_script(_BUCKET_LUA)
        self._reserve = client.register_script(_RESERVE_LUA)

    def take_start(self, subject: str) -> None:
        """Spend one start from the caller's bucket, or raise RateLimited."""
        wait_ms = int(
            self._bucket(
                keys=[k.start_bucket_key(subject)],
                args=list(BucketArgs(self.rate_per_s, self.burst)),
            )
        )
        if wait_ms > 0:
            raise RateLimited(
                wait_ms / 1000,
                f"too many turn starts: at most {self.burst} at once and "
                f"{self.rate_per_s:g} per second",
            )

    def reserve(self, subject: str) -> str:
        """Hold a running-turn slot for a start in progress; RateLimited if none is free."""
        reservation = f"r:{secrets.token_hex(8)}"
        key = k.owner_turns_key(subject)
        turns = [m for m in map(text, self.redis.zrange(key, 0, -1)) if not m.startswith("r:")]
        ended: list[str] = []
        if turns:
            pipe = self.redis.pipeline(transaction=False)
            for t in turns:
                pipe.hget(k.turn_key(t), "status")
            for t, raw in zip(turns, pipe.execute(), strict=True):
                if raw is None or str(json.loads(raw)) in TERMINAL_STATUSES:
                    ended.append(t)
        ok = self._reserve(
            keys=[key],
            args=argv_of(ReserveArgs(self.max_active, reservation, RESERVATION_TTL_S), ended),
        )
        if not ok:
            raise RateLimited(
                ACTIVE_RETRY_AFTER_S,
                f"too many running turns: at most {self.max_active} per key at once",
            )
        return reservation

    def started(self, subject: str, reservation: str, turn_id: str | None) -> None:
        """Turn the reservation into the started turn (or give it back: `turn_id` None)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(k.owner_turns_key(subject), reservation)
        if turn_id is not None:
            pipe.zadd(k.owner_turns_key(subject), {turn_id: time.time()})
        pipe.execute()


def retry_after_header(retry_after_s: float) -> str:
    """Retry-After takes whole seconds; round up so a client that obeys it is let in."""
    return str(max(1, math.ceil(retry_after_s)))


__all__ = ["StartLimits", "retry_after_header"]
