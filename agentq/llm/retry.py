"""When a failed model round is tried again, and after how long. Pure: no I/O, no sleeping.

The rules (design.md, "Time limits"):

- a user abort never retries, and wins over every other failure;
- an inactivity timeout retries only when no chunk had arrived (the request stalled
  before the model said anything), at most `max_retries` times;
- HTTP 429 and 5xx, and a dropped connection, retry with backoff; other 4xx never;
- a malformed chunk or an exhausted stream_duration_s never retries;
- nothing retries once a chunk has arrived: its deltas are already published, and
  replaying a generation half-way would show them twice;
- a busy answer never retries here (the fleet's capacity waits, not this stream), nor,
  with `failover`, a failure a retry would send to the same deployment again.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from agentq.errors import ModelBusy, ModelHTTPError, StreamIdleTimeout

BASE_BACKOFF_S = 0.2
MAX_BACKOFF_S = 30.0


def retryable_status(status_code: int) -> bool:
    """HTTP statuses worth another try: rate limits and server errors."""
    return status_code == 429 or status_code >= 500


def should_retry(
    exc: BaseException,
    *,
    chunks_received: int,
    attempt: int,
    max_retries: int,
    failover: bool = False,
) -> bool:
    """Whether to try again after attempt number `attempt` (1-based) failed with `exc`."""
    if isinstance(exc, ModelBusy) or failover or chunks_received or attempt > max_retries:
        return False
    return isinstance(exc, StreamIdleTimeout) or (isinstance(exc, ModelHTTPError) and exc.retryable)


JITTER = 0.25
"""The largest fraction by which a retry's exponential delay is cut at random."""


def backoff_s(
    attempt: int,
    retry_after_s: float | None = None,
    *,
    rand: Callable[[], float] = random.random,
) -> float:
    """Delay before the retry that follows failed attempt `attempt` (1-based): the server's
    Retry-After, else an exponential delay cut by up to JITTER at random, so streams that
    failed together do not retry together; both capped at MAX_BACKOFF_S."""
    if retry_after_s is not None:
        return min(max(retry_after_s, 0.0), MAX_BACKOFF_S)
    exponent = max(attempt, 1) - 1
    # Capping the exponent first keeps a huge attempt number from overflowing the float.
    delay_s = min(BASE_BACKOFF_S * 2.0 ** min(exponent, 32), MAX_BACKOFF_S)
    return delay_s * (1.0 - JITTER * rand())
