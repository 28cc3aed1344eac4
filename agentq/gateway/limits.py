"""Per-caller limits on starting turns, kept in Redis so every gateway shares them.

A caller (a key's name, or ``addr:<ip>`` without keys) gets a token bucket of
`start_burst` starts refilled at `start_rate_per_s`, and at most
`max_active_turns_per_key` running turns. Both checks are one Lua script each
(`agentq.limits`), so a flood of concurrent starts cannot slip past them between a read
and a write.
"""

from __future__ import annotations

import json
import math
import secrets

import redis

from agentq import constants as k
from agentq.errors import RateLimited
from agentq.limits.bucket import TokenBucket
from agentq.limits.semaphore import FOREVER, LeasedSemaphore
from agentq.models import TERMINAL_STATUSES

RESERVATION_TTL_S = 60
"""A reservation whose start never completed (a crashed gateway) frees its slot after this."""
ACTIVE_RETRY_AFTER_S = 1.0


class StartLimits:
    """The two limits on starting turns, for one gateway: a token bucket and a leased
    semaphore per caller (`agentq.limits`)."""

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
        self._bucket = TokenBucket(client, rate_per_s=rate_per_s, burst=burst)
        self._running = LeasedSemaphore(client, max_active)

    def take_start(self, subject: str) -> None:
        """Spend one start from the caller's bucket, or raise RateLimited."""
        wait_s = self._bucket.take(k.start_bucket_key(subject))
        if wait_s > 0:
            raise RateLimited(
                wait_s,
                f"too many turn starts: at most {self.burst} at once and "
                f"{self.rate_per_s:g} per second",
            )

    def reserve(self, subject: str) -> str:
        """Hold a running-turn place for a start in progress (leased: a gateway that dies
        mid-start frees it); RateLimited if none is free. The caller's turns that ended
        give theirs back first (their states are read here: on a Cluster they live on
        other slots than the caller's set)."""
        reservation = f"r:{secrets.token_hex(8)}"
        key = k.owner_turns_key(subject)
        turns = [m for m in self._running.holders(key) if not m.startswith("r:")]
        ended: list[str] = []
        if turns:
            pipe = self.redis.pipeline(transaction=False)
            for t in turns:
                pipe.hget(k.turn_key(t), "status")
            for t, raw in zip(turns, pipe.execute(), strict=True):
                if raw is None or str(json.loads(raw)) in TERMINAL_STATUSES:
                    ended.append(t)
        if not self._running.acquire(key, reservation, RESERVATION_TTL_S, ended):
            raise RateLimited(
                ACTIVE_RETRY_AFTER_S,
                f"too many running turns: at most {self.max_active} per key at once",
            )
        return reservation

    def started(self, subject: str, reservation: str, turn_id: str | None) -> None:
        """Turn the reservation into the started turn's place, held until the turn is
        found ended (or give it back: `turn_id` None)."""
        key = k.owner_turns_key(subject)
        if turn_id is None:
            self._running.release(key, reservation)
        else:
            # The reservation's place passes to the turn in one script: it always fits.
            self._running.acquire(key, turn_id, FOREVER, [reservation])


def retry_after_header(retry_after_s: float) -> str:
    """Retry-After takes whole seconds; round up so a client that obeys it is let in."""
    return str(max(1, math.ceil(retry_after_s)))
