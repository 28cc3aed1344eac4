"""A provider's limits for the scripted server (its `rate_limit` hook): requests and tokens
per second, and overloaded answers, in the shapes real providers have. The bench's capacity
stage and the fault suite's capacity tests run against each shape.

Providers differ, and a fleet cannot know which it talks to:

- `shape="window"`: counts in fixed wall-clock seconds (1,200 requests a minute is 20 in
  each second, reset on the second), as many providers quantise per-minute limits;
- `shape="bucket"`: a bucket of one second's worth, refilled continuously (OpenAI's
  limits behave so): a full bucket takes a burst, then one request per interval.

And they say different things:

- `headers="all"`: the `x-ratelimit-*` headers on every answer, 200s included, and
  `retry-after` (whole seconds) with `retry-after-ms` on a 429;
- `headers="refusals"`: the same headers, on 429s only;
- `headers="retry_after"`: a 429 says `retry-after` in whole seconds and nothing else.

Pure: the time is passed in.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from agentq.testing.openai_server import Verdict

LimiterShape = Literal["window", "bucket"]
HeaderMode = Literal["all", "refusals", "retry_after"]

SHAPES: dict[str, tuple[LimiterShape, HeaderMode]] = {
    "window": ("window", "all"),
    "window_bare": ("window", "retry_after"),
    "bucket": ("bucket", "all"),
    "bucket_refusals": ("bucket", "refusals"),
}
"""The named shapes the bench's capacity stage runs against: (limiter, headers)."""


def _reset(ms: int) -> str:
    """OpenAI's duration format for a reset: `250ms`, `1s`."""
    return f"{ms}ms" if ms < 1000 else f"{ms / 1000:g}s"


@dataclass
class _Allowance:
    """One limit's state: a window's use, or a bucket's level, at `at_s`."""

    used: float = 0.0
    at_s: float = -1.0


@dataclass
class ProviderLimits:
    """Limits of the scripted provider; None turns one off.

    ScriptedOpenAIServer(rate_limit=ProviderLimits(requests_per_s=4))
    """

    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    overloaded_every: int | None = None
    """Answer every Nth request `overloaded_status` (503, or 529 as some providers do)."""
    overloaded_status: int = 503
    shape: LimiterShape = "window"
    headers: HeaderMode = "all"
    admitted_at: list[float] = field(default_factory=list)
    """When each admitted request came (epoch seconds)."""
    refused: Counter[int] = field(default_factory=Counter)
    """Refused requests by status."""
    _requests: _Allowance = field(default_factory=_Allowance)
    _tokens: _Allowance = field(default_factory=_Allowance)
    _seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_shape(self, name: str) -> None:
        """Take one of the named SHAPES."""
        self.shape, self.headers = SHAPES[name]

    def reset(self) -> None:
        with self._lock:
            self.admitted_at.clear()
            self.refused.clear()
            self._requests, self._tokens, self._seen = _Allowance(), _Allowance(), 0

    def _level(self, a: _Allowance, per_s: float, now_s: float) -> None:
        """Bring `a` to `now_s`: a new window starts empty; a bucket drains as it refills."""
        if self.shape == "window":
            if math.floor(now_s) != math.floor(a.at_s):
                a.used = 0.0
        elif a.at_s >= 0:
            a.used = max(0.0, a.used - (now_s - a.at_s) * per_s)
        a.at_s = now_s

    def _reset_ms(self, a: _Allowance, per_s: float, now_s: float) -> int:
        """Until the allowance is whole again: the window's end, or the bucket full."""
        if self.shape == "window":
            return max(1, math.ceil((math.floor(now_s) + 1 - now_s) * 1000))
        return max(1, math.ceil(a.used / per_s * 1000))

    def _wait_ms(self, a: _Allowance, per_s: float, cost: float, now_s: float) -> int:
        """Until a request of `cost` would pass."""
        if self.shape == "window":
            return self._reset_ms(a, per_s, now_s)
        return max(1, math.ceil((a.used + cost - per_s) / per_s * 1000))

    def check(self, now_s: float, tokens: int) -> Verdict:
        """The verdict on a request of about `tokens` tokens arriving at `now_s`."""
        with self._lock:
            self._seen += 1
            rps, tps = self.requests_per_s, self.tokens_per_s
            if rps is not None:
                self._level(self._requests, rps, now_s)
            if tps is not None:
                self._level(self._tokens, tps, now_s)
            every = self.overloaded_every
            if every and self._seen % every == 0:
                self.refused[self.overloaded_status] += 1
                return Verdict(
                    self.overloaded_status, {}, "overloaded", "scripted: the model is overloaded"
                )
            over_requests = rps is not None and self._requests.used + 1 > rps + 1e-9
            # A request larger than a whole second's tokens still goes when nothing is used.
            over_tokens = (
                tps is not None and self._tokens.used + tokens > tps and self._tokens.used > 0
            )
            if over_requests or over_tokens:
                self.refused[429] += 1
                wait_ms = max(
                    self._wait_ms(self._requests, rps, 1, now_s) if over_requests and rps else 1,
                    self._wait_ms(self._tokens, tps, tokens, now_s) if over_tokens and tps else 1,
                )
                headers = {"retry-after": str(max(1, math.ceil(wait_ms / 1000)))}
                if self.headers != "retry_after":
                    headers["retry-after-ms"] = str(wait_ms)
                    headers.update(self._headers(now_s))
                what = "requests" if over_requests else "tokens"
                return Verdict(
                    429, headers, what, f"scripted: rate limit reached for {what} per second"
                )
            self._requests.used += 1
            self._tokens.used += tokens
            self.admitted_at.append(now_s)
            return Verdict(200, self._headers(now_s) if self.headers == "all" else {})

    def _headers(self, now_s: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, per_s, a in (
            ("requests", self.requests_per_s, self._requests),
            ("tokens", self.tokens_per_s, self._tokens),
        ):
            if per_s is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(int(per_s * 60))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(per_s - a.used)))
            out[f"x-ratelimit-reset-{kind}"] = _reset(self._reset_ms(a, per_s, now_s))
        return out

    def most_in_one_second(self) -> int:
        """The most requests admitted in any one-second window (sliding)."""
        times = sorted(self.admitted_at)
        best, j = 0, 0
        for i, t in enumerate(times):
            while times[j] <= t - 1.0:
                j += 1
            best = max(best, i - j + 1)
        return best
