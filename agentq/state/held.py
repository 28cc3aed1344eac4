"""Writes a process holds while Redis is away: tried again until it answers or a deadline passes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.exceptions import ClusterDownError, TryAgainError

log = logging.getLogger("agentq.state")

T = TypeVar("T")

REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError)
"""What a write raises while Redis is away (BusyLoadingError, AOF loading, is a ConnectionError)."""
HOLD_RETRY_S = 0.5
"""How often a held write asks Redis again, once the client's own retries ran out."""


class HeldWrites:
    """The writes this process holds; the I/O worker takes no new call while it holds any."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def hold(self, write: Callable[[], T], until: float, what: str) -> T:
        """`write()`, tried every HOLD_RETRY_S while Redis is away until `until`, then raised."""
        held = False
        try:
            while True:
                try:
                    done = write()
                    if held:
                        log.info("Redis answered: %s written", what)
                    return done
                except REDIS_AWAY as exc:
                    if time.time() >= until:
                        log.error("Redis stayed away: %s not written (%s)", what, exc)
                        raise
                    if not held:
                        held = True
                        with self._cond:
                            self.count += 1
                        log.warning("Redis is away: holding %s until it answers (%s)", what, exc)
                    time.sleep(HOLD_RETRY_S)
        finally:
            if held:
                with self._cond:
                    self.count -= 1
                    self._cond.notify_all()

    def wait_none(self, timeout_s: float) -> bool:
        """Wait until no write is held (at most `timeout_s`); True if none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count == 0, timeout_s)


held_writes = HeldWrites()
