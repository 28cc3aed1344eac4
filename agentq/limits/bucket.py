"""Pacing by GCRA (a token bucket kept as one arrival time): `GCRA_LUA` for scripts that
pace several limits at once, `TokenBucket` for one rate and burst a key."""

from __future__ import annotations

from typing import Any, NamedTuple

from agentq.events.lua_args import LuaScript, bind_lua
from agentq.limits import REDIS_NOW_MS_LUA

# GCRA_LUA: each limit is one field of a hash: its theoretical arrival time (ms). A limit
# lets one request through every `interval_ms` and runs at most `burst_ms` ahead of that
# pace; the arrival time never lags behind `at`, so an idle limit saves up no credit.
GCRA_LUA = """
-- When a request may pass.
local function gcra_ready(key, field, interval_ms, burst_ms, at)
  local tat = math.max(tonumber(redis.call('HGET', key, field)) or 0, at)
  return tat - math.max(burst_ms - interval_ms, 0)
end

-- Counts `cost` requests (negative: gives them back) from `at`.
local function gcra_add(key, field, interval_ms, cost, at)
  local tat = tonumber(redis.call('HGET', key, field)) or 0
  if cost > 0 then
    tat = math.max(tat, at)
  elseif tat == 0 then
    return
  end
  redis.call('HSET', key, field, string.format('%.17g', tat + cost * interval_ms))
end

-- No burst before `at`: requests go on from there at the pace.
local function gcra_defer(key, field, interval_ms, burst_ms, at)
  local tat = at + math.max(burst_ms - interval_ms, 0)
  if tat > (tonumber(redis.call('HGET', key, field)) or 0) then
    redis.call('HSET', key, field, string.format('%.17g', tat))
  end
end
"""


class BucketArgs(NamedTuple):
    rate_per_s: float
    burst: int


# TAKE_LUA: one request paced on `bucket_key`. Returns 0 when it may go, else the
# milliseconds until one may.
TAKE_LUA = (
    bind_lua(("bucket_key",), BucketArgs)
    + REDIS_NOW_MS_LUA
    + GCRA_LUA
    + """
local now = redis_now_ms()
local interval = 1000 / tonumber(rate_per_s)
local burst_ms = tonumber(burst) * interval
-- A bucket spent under other settings (another gateway's, or before a change) owes the
-- tokens it owed there, at most an empty bucket here: not the other rate's time.
local st = redis.call('HMGET', bucket_key, 'tat', 'iv')
local tat, iv = tonumber(st[1]), tonumber(st[2])
if tat and iv and iv ~= interval and tat > now then
  local owed_ms = math.min((tat - now) / iv * interval, burst_ms)
  redis.call('HSET', bucket_key, 'tat', string.format('%.17g', now + owed_ms))
end
local ready = gcra_ready(bucket_key, 'tat', interval, burst_ms, now)
if ready > now then return math.ceil(ready - now) end
gcra_add(bucket_key, 'tat', interval, 1, now)
if iv ~= interval then redis.call('HSET', bucket_key, 'iv', string.format('%.17g', interval)) end
redis.call('PEXPIRE', bucket_key, math.ceil(burst_ms) + 1000)
return 0
"""
)


class TokenBucket:
    """Buckets, one per key: `burst` requests at once, then `rate_per_s`."""

    _take = LuaScript(TAKE_LUA)

    def __init__(self, client: Any, *, rate_per_s: float, burst: int) -> None:
        self.redis = client
        self._args = BucketArgs(rate_per_s, burst)

    def take(self, key: str) -> float:
        """Take a token from `key`'s bucket: 0.0, or the seconds until one is there."""
        return int(self._take(keys=[key], args=list(self._args))) / 1000
