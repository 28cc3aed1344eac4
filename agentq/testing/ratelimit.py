"""A provider's limits for the scripted server: requests and tokens per second, and
overloaded answers, with the headers OpenAI sends.

Providers quantise their per-minute limits into one-second windows (1,200 requests a
minute is about 20 in any one second), so this counts in wall-clock seconds and refuses
past the limit with 429, `retry-after` and the `x-ratelimit-*` headers; every answer it
admits carries the `x-ratelimit-*` headers too, so a client can pace itself. Pure: the
time is passed in.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    """Admit (200) or refuse (429, 503, 529) one request, with the headers to send."""

    status: int
    headers: dict[str, str]
    kind: str = ""
    message: str = ""


def _reset(ms: int) -> str:
    """OpenAI's duration format for a reset: `250ms`, `1s`."""
    return f"{ms}ms" if ms < 1000 else f"{ms / 1000:g}s"


@dataclass
class ProviderLimits:
    """Limits of the scripted provider; None turns one off."""

    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    overloaded_every: int | None = None
    """Answer every Nth request `overloaded_status` (503, or 529 as some providers do)."""
    overloaded_status: int = 503
    admitted_at: list[float] = field(default_factory=list)
    """When each admitted request came (epoch seconds)."""
    refused: Counter[int] = field(default_factory=Counter)
    """Refused requests by status."""
    _window: int = -1
    _requests: int = 0
    _tokens: int = 0
    _seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.admitted_at.clear()
            self.refused.clear()
            self._window, self._requests, self._tokens, self._seen = -1, 0, 0, 0

    def check(self, now_s: float, tokens: int) -> Verdict:
        """The verdict on a request of about `tokens` tokens arriving at `now_s`."""
        with self._lock:
            self._seen += 1
            window = math.floor(now_s)
            if window != self._window:
                self._window, self._requests, self._tokens = window, 0, 0
            reset_ms = max(1, math.ceil((window + 1 - now_s) * 1000))
            every = self.overloaded_every
            if every and self._seen % every == 0:
                self.refused[self.overloaded_status] += 1
                return Verdict(
                    self.overloaded_status, {}, "overloaded", "scripted: the model is overloaded"
                )
            rps, tps = self.requests_per_s, self.tokens_per_s
            over_requests = rps is not None and self._requests + 1 > rps
            # A request larger than a whole window's tokens still goes when the window is empty.
            over_tokens = tps is not None and self._tokens + tokens > tps and self._tokens > 0
            if over_requests or over_tokens:
                self.refused[429] += 1
                headers = {
                    "retry-after": str(max(1, math.ceil(reset_ms / 1000))),
                    "retry-after-ms": str(reset_ms),
                    **self._headers(reset_ms),
                }
                what = "requests" if over_requests else "tokens"
                return Verdict(
                    429, headers, what, f"scripted: rate limit reached for {what} per second"
                )
            self._requests += 1
            self._tokens += tokens
            self.admitted_at.append(now_s)
            return Verdict(200, self._headers(reset_ms))

    def _headers(self, reset_ms: int) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.requests_per_s is not None:
            out["x-ratelimit-limit-requests"] = str(int(self.requests_per_s * 60))
            left = max(0, int(self.requests_per_s) - self._requests)
            out["x-ratelimit-remaining-requests"] = str(left)
            out["x-ratelimit-reset-requests"] = _reset(reset_ms)
        if self.tokens_per_s is not None:
            out["x-ratelimit-limit-tokens"] = str(int(self.tokens_per_s * 60))
            out["x-ratelimit-remaining-tokens"] = str(max(0, int(self.tokens_per_s) - self._tokens))
            out["x-ratelimit-reset-tokens"] = _reset(reset_ms)
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
