"""A token bucket: `burst` at once, refilled at `rate_per_s`, one per key."""

from __future__ import annotations

from typing import Any, NamedTuple

from agentq.events.lua_args import bind_lua


class BucketArgs(NamedTuple):
    rate_per_s: float
    burst: int


# TAKE_LUA: one token from the bucket, on Redis's own clock. Returns 0 when one was taken,
# else the milliseconds until one is.
TAKE_LUA = (
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


class TokenBucket:
    """Buckets of one rate and burst, one per key."""

    def __init__(self, client: Any, *, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._take = client.register_script(TAKE_LUA)

    def take(self, key: str) -> float:
        """Take a token from `key`'s bucket: 0.0, or the seconds until one is there."""
        args = BucketArgs(self.rate_per_s, self.burst)
        return int(self._take(keys=[key], args=list(args))) / 1000
