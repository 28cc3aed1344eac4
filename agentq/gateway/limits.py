"""Per-caller limits on starting turns, in Redis so every gateway shares them, one script
each (`agentq.limits`), so concurrent starts cannot slip past between a read and a write."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import RateLimited
from agentq.limits.bucket import TokenBucket
from agentq.limits.semaphore import FOREVER, LeasedSemaphore
from agentq.models import TERMINAL_STATUSES, TurnHandle
from agentq.state.base import statuses

if TYPE_CHECKING:
    from agentq.gateway.auth import Principal

RESERVATION_TTL_S = 60
"""A reservation whose start never completed (a crashed gateway) frees its slot after this."""
ACTIVE_RETRY_AFTER_S = 1.0


class StartLimits:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        self._bucket = TokenBucket(
            client, rate_per_s=settings.start_rate_per_s, burst=settings.start_burst
        )
        self._running = LeasedSemaphore(client, settings.max_active_turns_per_key)

    def start(
        self, principal: Principal | None, host: str, start: Callable[[], TurnHandle]
    ) -> TurnHandle:
        """`start()` a turn within the caller's limits, else RateLimited. A place is leased
        for the start (a gateway that dies mid-start frees it), then passes to the turn; ended
        turns give theirs back first (read here: on a Cluster they are on other slots)."""
        subject = principal.name if principal else f"addr:{host or 'unknown'}"
        wait_s = self._bucket.take(k.limits_key(subject, "bucket"))
        if wait_s > 0:
            raise RateLimited(
                wait_s,
                f"too many turn starts: at most {self.settings.start_burst} at once and "
                f"{self.settings.start_rate_per_s:g} per second",
            )
        reservation = f"r:{secrets.token_hex(8)}"
        key = k.limits_key(subject, "turns")
        turns = [m for m in self._running.holders(key) if not m.startswith("r:")]
        got = statuses(self.redis, turns)
        ended = [t for t, s in zip(turns, got, strict=True) if s in (None, *TERMINAL_STATUSES)]
        if not self._running.acquire(key, reservation, RESERVATION_TTL_S, ended):
            raise RateLimited(
                ACTIVE_RETRY_AFTER_S,
                f"too many running turns: at most {self.settings.max_active_turns_per_key} "
                "per key at once",
            )
        try:
            handle = start()
        except BaseException:
            self._running.release(key, reservation)
            raise
        # The reservation's place passes to the turn in one script: it always fits.
        self._running.acquire(key, handle.turn_id, FOREVER, [reservation])
        return handle


def retry_after_header(retry_after_s: float) -> str:
    """Retry-After takes whole seconds; round up so a client that obeys it is let in."""
    return str(max(1, math.ceil(retry_after_s)))
