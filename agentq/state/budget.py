"""Spend's pure decisions: what a round's tokens cost, when a key's period ends, and
whether a key is over its budget. (How much completion the budgets left allow a round is
decided in one place, atomically: `spend.RESERVE_LUA`.) Nothing here reads a clock or
Redis: tests call it with numbers."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agentq.config import KeyBudget, ModelPrice

TOKENS_PER_MILLION = 1_000_000

MIN_COMPLETION_TOKENS = 16
"""A round the budgets leave fewer completion tokens than this (or than it wants, if less)
is not sent: the turn cannot afford it."""

Scope = Literal["turn", "parent_turn", "key"]
Unit = Literal["tokens", "usd"]


@dataclass(frozen=True)
class Budget:
    """One limit a round counts against, and what was spent of it."""

    scope: Scope
    name: str
    """max_tokens, max_cost_usd, tokens_per_day, usd_per_day or usd_per_month."""
    unit: Unit
    limit: float
    spent: float


def per_token(usd_per_million: float) -> float:
    return usd_per_million / TOKENS_PER_MILLION


def cost_usd(
    price: ModelPrice | None, prompt: int, completion: int, cached: int = 0
) -> float | None:
    """What the tokens cost at `price` (None: the model has no price). Cached prompt tokens
    are priced at `cached_input` (the `input` price when unset)."""
    if price is None:
        return None
    cached = min(max(cached, 0), max(prompt, 0))
    cached_price = price.input if price.cached_input is None else price.cached_input
    usd = (prompt - cached) * price.input + cached * cached_price + completion * price.output
    return usd / TOKENS_PER_MILLION


def day_of(now: float) -> str:
    """The UTC day of `now` (epoch s), as the per-day usage keys name it: YYYYMMDD."""
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y%m%d")


def month_of(day: str) -> str:
    return day[:6]


def resets_at(budget: str, now: float) -> float:
    """When a key's `budget` (tokens_per_day, usd_per_day, usd_per_month) starts afresh:
    the next UTC midnight, or the first of next month."""
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    if budget == "usd_per_month":
        year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
        return dt.datetime(year, month, 1, tzinfo=dt.timezone.utc).timestamp()
    day = dt.datetime(t.year, t.month, t.day, tzinfo=dt.timezone.utc)
    return (day + dt.timedelta(days=1)).timestamp()


def key_budgets(
    budget: KeyBudget | None, day_tokens: float, day_usd: float, month_usd: float
) -> list[Budget]:
    """A key's limits with what it spent of each this period."""
    if budget is None:
        return []
    spent = {"tokens_per_day": day_tokens, "usd_per_day": day_usd, "usd_per_month": month_usd}
    return [
        Budget("key", name, "tokens" if name == "tokens_per_day" else "usd", limit, used)
        for name, used in spent.items()
        if (limit := getattr(budget, name)) is not None
    ]


def over(budgets: list[Budget], tokens: int = 0, usd: float = 0.0) -> Budget | None:
    """The first budget that cannot afford `tokens` (or `usd`) more, if any: a key that may
    start no turn, as the least round it could run would pass its budget."""
    return next(
        (b for b in budgets if b.spent + (tokens if b.unit == "tokens" else usd) > b.limit),
        None,
    )


def lower_limit(requested: float | None, default: float | None) -> float | None:
    """A turn's limit: its request's, which may lower its agent's default but not raise it."""
    return min((v for v in (requested, default) if v is not None), default=None)
