"""Step durations for Prometheus: counted in each process that runs steps, added to the
fleet's totals in Redis every `metrics_flush_s`, read by the gateway's /metrics.

A step takes milliseconds and runs in turn workers, tool children and loop workers
alike, so neither a scrape port per process nor a Redis write per step: a local
histogram, added to Redis by a thread of the process (started by its first step).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time

import redis

from agentq.constants import STEP_DURATIONS
from agentq.errors import REDIS_ERRORS

log = logging.getLogger("agentq.telemetry")

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper bounds (seconds); a step past the last one counts in `le:+Inf`."""


def bucket_field(le_s: float) -> str:
    return f"le:{le_s:g}"


INF_FIELD = "le:+Inf"


class StepTimes:
    """This process's step durations not yet added to Redis, and the thread that adds them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(STEP_BUCKETS_S) + 1)
        self._sum_s = 0.0
        self._pid = 0

    def observe(self, seconds: float, client: redis.Redis, flush_s: float) -> None:
        """Count one step; the process's flusher adds the counts to Redis every `flush_s`."""
        with self._lock:
            if self._pid != os.getpid():
                self._start(client, flush_s)
            self._counts[bisect.bisect_left(STEP_BUCKETS_S, seconds)] += 1
            self._sum_s += seconds

    def _start(self, client: redis.Redis, flush_s: float) -> None:
        # A forked child starts with its parent's counts, which the parent flushes itself.
        self._pid = os.getpid()
        self._counts = [0] * len(self._counts)
        self._sum_s = 0.0
        thread = threading.Thread(
            target=self._run, args=(client, flush_s), name="agentq-step-times", daemon=True
        )
        thread.start()

    def _run(self, client: redis.Redis, flush_s: float) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(flush_s)
            self.flush(client)

    def stop(self) -> None:
        """Stop the flusher thread (after its current sleep); counts stay until `flush`."""
        with self._lock:
            self._pid = 0

    def flush(self, client: redis.Redis) -> None:
        with self._lock:
            counts, total_s = self._counts, self._sum_s
            self._counts, self._sum_s = [0] * len(counts), 0.0
        n = sum(counts)
        if not n:
            return
        try:
            pipe = client.pipeline(transaction=False)
            fields = [bucket_field(le_s) for le_s in STEP_BUCKETS_S] + [INF_FIELD]
            for field, c in zip(fields, counts, strict=True):
                if c:
                    pipe.hincrby(STEP_DURATIONS, field, c)
            pipe.hincrbyfloat(STEP_DURATIONS, "sum", total_s)
            pipe.hincrby(STEP_DURATIONS, "count", n)
            pipe.execute()
        except REDIS_ERRORS as exc:
            # Kept for the next flush: a Redis blip loses no counts.
            log.debug("step durations not flushed: %s", exc)
            with self._lock:
                self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
                self._sum_s += total_s


def read_histogram(client: redis.Redis) -> tuple[list[tuple[str, float]], float] | None:
    """The fleet's step durations as cumulative (le, count) pairs and the sum, or None."""
    raw = client.hgetall(STEP_DURATIONS)
    if not raw:
        return None
    got = {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}
    buckets: list[tuple[str, float]] = []
    running = 0.0
    for le_s in STEP_BUCKETS_S:
        running += got.get(bucket_field(le_s), 0.0)
        buckets.append((f"{le_s:g}", running))
    running += got.get(INF_FIELD, 0.0)
    buckets.append(("+Inf", running))
    return buckets, got.get("sum", 0.0)


step_times = StepTimes()
"""The process's counts."""

__all__ = ["STEP_BUCKETS_S", "StepTimes", "read_histogram", "step_times"]
