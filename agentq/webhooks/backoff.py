"""What an attempt's answer means and when the next attempt is due: pure functions of time,
tested without waiting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pending", "delivered", "gone", "failed"]

JITTER = 0.2
"""Each wait is shortened by up to this fraction, so retries of many deliveries spread out."""


def retry_delay_s(attempts: int, base_s: float, max_s: float, jitter: float = 0.0) -> float:
    """The wait after the `attempts`-th failed attempt: base, 2 x base, 4 x base ... capped
    at `max_s`; `jitter` in [0, 1) takes up to JITTER of it off."""
    if attempts < 1:
        raise ValueError("attempts counts the attempts made: at least 1")
    # The exponent is capped so that a long-failing delivery never overflows a float.
    delay = min(max_s, base_s * 2.0 ** min(attempts - 1, 60))
    return delay * (1 - JITTER * min(max(jitter, 0.0), 0.999))


@dataclass(frozen=True)
class Outcome:
    status: Status
    next_at: float | None
    """When the next attempt is due (status pending), else None."""


def outcome(
    status_code: int | None,
    *,
    attempts: int,
    created_at: float,
    now: float,
    base_s: float,
    max_s: float,
    max_age_s: float,
    jitter: float = 0.0,
) -> Outcome:
    """After the `attempts`-th attempt answered `status_code` (None: no answer): a 2xx
    delivers, a 410 stops for good, anything else retries until `max_age_s` after the
    delivery was queued."""
    if status_code is not None and 200 <= status_code < 300:
        return Outcome("delivered", None)
    if status_code == 410:
        return Outcome("gone", None)
    next_at = now + retry_delay_s(attempts, base_s, max_s, jitter)
    if next_at > created_at + max_age_s:
        return Outcome("failed", None)
    return Outcome("pending", next_at)
