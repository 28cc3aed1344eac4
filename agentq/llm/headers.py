"""What a provider's answer says about its capacity: the busy statuses, `Retry-After`, and
the rate-limit headers (OpenAI's `x-ratelimit-*`, Anthropic's `anthropic-ratelimit-*`)."""

from __future__ import annotations

import contextlib
import email.utils
import math
import re
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

BUSY_STATUSES = frozenset({429, 503, 529})
"""Rate limited (429) or overloaded (503, and 529 as some providers send it): the provider
lacks capacity, the request itself is fine."""


def rate_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The provider's rate-limit headers only, lowercased."""
    return {
        name.lower(): value
        for name, value in headers.items()
        if name.lower().startswith(("retry-after", "x-ratelimit-", "anthropic-ratelimit-"))
    }


def parse_retry_after(headers: Mapping[str, str], *, now_s: float | None = None) -> float | None:
    """Seconds the server asked us to wait, from `retry-after-ms` or `Retry-After` (seconds
    or an HTTP date, which `now_s`, epoch seconds, anchors); header names in any case."""
    lowered = {k.lower(): v for k, v in headers.items()}
    with contextlib.suppress(ValueError):
        ms = float(lowered.get("retry-after-ms", ""))
        if math.isfinite(ms):  # a NaN pause would reach the event loop's timer heap
            return max(ms / 1000.0, 0.0)
    raw = lowered.get("retry-after")
    return None if raw is None else _until_s(raw, time.time() if now_s is None else now_s)


class RateSignal(BaseModel):
    """What a provider's response headers say about its rate limits (None: not sent)."""

    model_config = ConfigDict(frozen=True)

    pause_s: float | None = None
    """Retry-After: wait this long before the next request."""
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    """Until the request allowance is full again."""
    reset_tokens_s: float | None = None
    limit_requests: int | None = None
    limit_tokens: int | None = None


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|us|µs|ns|h|m|s|d)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_UNIT_S["ns"] = 1e-9


def parse_duration_s(text: str) -> float | None:
    """Seconds in an OpenAI reset duration (`1s`, `250ms`, `6m0s`, `1h2m3.5s`, or plain
    seconds); None when it is not one."""
    text = text.strip()
    with contextlib.suppress(ValueError):
        plain = float(text)
        return max(plain, 0.0) if math.isfinite(plain) else None
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _until_s(text: str, now_s: float) -> float | None:
    """Seconds from now to an RFC 3339 or HTTP date, or a duration; None if unreadable."""
    duration = parse_duration_s(text)
    if duration is not None:
        return duration
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
    return None if when.tzinfo is None else max(when.timestamp() - now_s, 0.0)


def parse_rate_headers(headers: Mapping[str, str], *, now_s: float | None = None) -> RateSignal:
    """The rate-limit signal in a response's headers; `now_s` anchors dates."""
    h = {k.lower(): v for k, v in headers.items()}
    now = time.time() if now_s is None else now_s
    fields: dict[str, Any] = {"pause_s": parse_retry_after(h, now_s=now)}
    for kind in ("requests", "tokens"):
        for what in ("remaining", "limit", "reset"):
            raw = h.get(f"x-ratelimit-{what}-{kind}") or h.get(f"anthropic-ratelimit-{kind}-{what}")
            if raw is None:
                continue  # not sent: None
            if what == "reset":
                fields[f"reset_{kind}_s"] = _until_s(raw, now)
            else:
                with contextlib.suppress(ValueError, OverflowError):  # unreadable: None
                    fields[f"{what}_{kind}"] = int(float(raw))
    return RateSignal(**fields)
