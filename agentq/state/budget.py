"""Spend's pure decisions: a round's cost, when a key's period ends (RESERVE_LUA spends)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from agentq.models import Usage

if TYPE_CHECKING:
    from agentq.config import ModelPrice

TOKENS_PER_MILLION = 1_000_000

MIN_COMPLETION_TOKENS = 16
"""A round the budgets leave fewer completion tokens (or than it wants, if less) is not sent."""


def per_token(usd_per_million: float) -> float:
    return usd_per_million / TOKENS_PER_MILLION


def cost_usd(
    price: ModelPrice | None, prompt: int, completion: int, cached: int = 0
) -> float | None:
    """What the tokens cost at `price` (None: no price); cached ones at `cached_input`, if set."""
    if price is None:
        return None
    cached = min(max(cached, 0), max(prompt, 0))
    cached_price = price.input if price.cached_input is None else price.cached_input
    usd = (prompt - cached) * price.input + cached * cached_price + completion * price.output
    return usd / TOKENS_PER_MILLION


def charged(usage: Usage | None, prompt: int, completion: int, price: ModelPrice | None) -> Usage:
    """A round's usage (`prompt` + `completion` estimated if none was counted), priced."""
    if usage is None:
        total = prompt + completion
        usage = Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, estimated=True
        )
    if usage.cost_usd is None and price is not None:
        cost = cost_usd(price, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        usage = usage.model_copy(update={"cost_usd": cost})
    return usage


def day_of(now: float) -> str:
    """The UTC day of `now` (epoch s), as the per-day usage keys name it: YYYYMMDD."""
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y%m%d")


def resets_at(budget: str, day: str) -> float:
    """When a key's `budget` spent on `day` starts afresh: next UTC midnight or month."""
    t = dt.datetime.strptime(day, "%Y%m%d").replace(tzinfo=dt.timezone.utc)
    if budget == "usd_per_month":
        year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
        return dt.datetime(year, month, 1, tzinfo=dt.timezone.utc).timestamp()
    return (t + dt.timedelta(days=1)).timestamp()


def lower_limit(requested: float | None, default: float | None) -> float | None:
    """A turn's limit: its request's, which may lower its agent's default but not raise it."""
    return min((v for v in (requested, default) if v is not None), default=None)
