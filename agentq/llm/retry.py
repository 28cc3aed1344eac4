"""When a failed model round is tried again, and after how long; pure. A user abort never
retries and wins over any failure. A stall, a 5xx or a dropped connection retries with
backoff, up to `max_retries`, while no chunk has arrived (its deltas are published: a
replay would show them twice); other 4xx, a malformed chunk and a spent duration budget
never do; nor does a busy answer (the fleet's capacity waits, not this stream), nor, with
`failover`, a failure a retry would send to the same deployment again.
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
