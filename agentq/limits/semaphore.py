"""Leases on places: at most `limit` holders at once, fleet-wide, each until it gives its
place back or its lease lapses (so a dead holder's place frees itself). `LEASES_LUA` for
scripts that keep more per lease, `LeasedSemaphore` for places alone."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from agentq.constants import SLOTS_CHANNEL
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.limits import REDIS_NOW_MS_LUA

FOREVER = "+inf"
"""A lease that never lapses: the place is given back, or dropped as `ended`, only."""

# LEASES_LUA: a set of leases is a sorted set of holders by the ms their lease ends.
LEASES_LUA = """
-- Drops the leases lapsed by `at`: all at once, or (with `undo`, for a script that keeps
-- state per lease) a hundred at most, each handed to `undo` after it is dropped.
local function leases_lapse(key, at, undo)
  if not undo then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', at)
    return
  end
  local gone = redis.call('ZRANGEBYSCORE', key, '-inf', at, 'LIMIT', 0, 100)
  if gone[1] then redis.call('ZREM', key, unpack(gone)) end
  for _, holder in ipairs(gone) do undo(holder) end
end

-- Whether `limit` places are held (0: no limit).
local function leases_full(key, limit)
  return limit > 0 and redis.call('ZCARD', key) >= limit
end

-- When the soonest lease ends (not before `at` + 1).
local function leases_next_end(key, at)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if first[1] then return math.max(tonumber(first[2]), at + 1) end
  return at + 1
end

-- Gives `holder` a lease to `until_at` ('+inf': until given back); `renew`: only if it
-- holds one (false when it holds none).
local function lease_hold(key, holder, until_at, renew)
  if renew and not redis.call('ZSCORE', key, holder) then return false end
  redis.call('ZADD', key, until_at, holder)
  return true
end
"""


class AcquireArgs(NamedTuple):
    holder: str
    lease_ms: str
    """Milliseconds the place is held from now (FOREVER: until given back)."""
    limit: int


# ACQUIRE_LUA: drops the places of the holders ARGV names after the named arguments (their
# owners know they are over) and the lapsed ones, then gives `holder` a place (or renews
# the one it has) if fewer than `limit` are held: 0, else the ms until the soonest lease
# lapses. The key lives as long as its longest lease (a week at most, for places held
# FOREVER).
ACQUIRE_LUA = (
    bind_lua(("key",), AcquireArgs, rest="ended")
    + REDIS_NOW_MS_LUA
    + LEASES_LUA
    + """
local now = redis_now_ms()
if #ARGV >= ended_at then redis.call('ZREM', key, unpack(ARGV, ended_at)) end
leases_lapse(key, now - 1)
if not redis.call('ZSCORE', key, holder) and leases_full(key, tonumber(limit)) then
  return math.min(leases_next_end(key, now) - now, 86400000)  -- a day for FOREVER
end
local forever = lease_ms == '+inf'
lease_hold(key, holder, forever and '+inf' or now + tonumber(lease_ms))
local ttl_ms = 7 * 24 * 3600 * 1000
if not forever then ttl_ms = math.min(ttl_ms, tonumber(lease_ms) + 1000) end
if redis.call('PTTL', key) < ttl_ms then redis.call('PEXPIRE', key, ttl_ms) end
return 0
"""
)


class LeasedSemaphore:
    """Semaphores of `limit` places, one per key."""

    _acquire = LuaScript(ACQUIRE_LUA)

    def __init__(self, client: Any, limit: int) -> None:
        self.redis = client
        self.limit = limit

    def acquire(
        self, key: str, holder: str, lease_s: float | str, ended: list[str] | None = None
    ) -> bool:
        """Take or renew `holder`'s place for `lease_s` after dropping the `ended` holders;
        False when all places are held."""
        return self.acquire_or_wait_ms(key, holder, lease_s, ended) == 0

    def acquire_or_wait_ms(
        self, key: str, holder: str, lease_s: float | str, ended: list[str] | None = None
    ) -> int:
        """`acquire`: 0 for a place, else the ms until the soonest lease lapses."""
        lease_ms = FOREVER if lease_s == FOREVER else str(math.ceil(float(lease_s) * 1000))
        args = AcquireArgs(holder, lease_ms, self.limit)
        return int(self._acquire(keys=[key], args=[*args, *(ended or [])]))

    def release(self, key: str, holder: str, *, wake: bool = False) -> None:
        """Give `holder`'s place back; `wake`: tell the waiters on SLOTS_CHANNEL."""
        if self.redis.zrem(key, holder) and wake:
            self.redis.publish(SLOTS_CHANNEL, key)

    def holders(self, key: str) -> list[str]:
        """Every holder with a place, lapsed ones included until the next acquire."""
        return [h.decode() for h in self.redis.zrange(key, 0, -1)]
