"""A leased semaphore: at most `limit` holders at once, fleet-wide; each holds a place
until it gives it back or its lease lapses, so a holder whose process died frees its place
at its lease's end without anyone's help."""

from __future__ import annotations

from typing import Any, NamedTuple

from agentq.events.lua_args import argv_of, bind_lua

FOREVER = "+inf"
"""A lease that never lapses: the place is given back, or dropped as `ended`, only."""


class AcquireArgs(NamedTuple):
    holder: str
    lease_s: str
    """Seconds the place is held from now (FOREVER: until given back)."""
    limit: int


# ACQUIRE_LUA: drops the places of the holders ARGV names after the named arguments (their
# owners know they are over) and the lapsed ones, then gives `holder` a place (or renews
# the one it has) if fewer than `limit` are held: 1, else 0. The key lives as long as its
# longest lease (a week at most, for places held FOREVER).
ACQUIRE_LUA = (
    bind_lua(("key",), AcquireArgs, rest="ended")
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if #ARGV >= ended_at then redis.call('ZREM', key, unpack(ARGV, ended_at)) end
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. now)
if not redis.call('ZSCORE', key, holder) and redis.call('ZCARD', key) >= tonumber(limit) then
  return 0
end
local until_at = lease_s == '+inf' and '+inf' or tostring(now + tonumber(lease_s))
redis.call('ZADD', key, until_at, holder)
local ttl_s = 7 * 24 * 3600
if lease_s ~= '+inf' then ttl_s = math.min(ttl_s, math.ceil(tonumber(lease_s)) + 1) end
if redis.call('TTL', key) < ttl_s then redis.call('EXPIRE', key, ttl_s) end
return 1
"""
)


class LeasedSemaphore:
    """Semaphores of `limit` places, one per key (a sorted set of holders by lease end)."""

    def __init__(self, client: Any, limit: int) -> None:
        self.redis = client
        self.limit = limit
        self._acquire = client.register_script(ACQUIRE_LUA)

    def acquire(
        self, key: str, holder: str, lease_s: float | str, ended: list[str] | None = None
    ) -> bool:
        """Take (or renew) `holder`'s place in `key`'s semaphore for `lease_s` seconds,
        after dropping the `ended` holders; False when all places are held."""
        args = AcquireArgs(holder, str(lease_s), self.limit)
        return bool(self._acquire(keys=[key], args=argv_of(args, ended or [])))

    def release(self, key: str, holder: str) -> None:
        self.redis.zrem(key, holder)

    def holders(self, key: str) -> list[str]:
        """Every holder with a place, lapsed ones included until the next acquire."""
        return [
            h.decode() if isinstance(h, bytes) else str(h) for h in self.redis.zrange(key, 0, -1)
        ]
