"""The turn's side of spend: before a round is sent, reserve what it may cost against the
turn's, its parents' and its key's budgets (the turn fails `budget_exceeded` when they
cannot afford it); when its result is in, settle the reservation to its usage and add
that to the turn's totals. See docs/spend.md and `agentq.state.spend`."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import redis

from agentq.config import Settings
from agentq.errors import BudgetExceeded
from agentq.llm.limits import CHARS_PER_TOKEN
from agentq.models import LlmRoundResult, Usage
from agentq.state.budget import cost_usd, day_of, lower_limit, resets_at
from agentq.state.spend import Reserved, Spend
from agentq.state.turn_state import TurnState
from agentq.tools.registry import all_tools, schemas_json

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


_spends: dict[tuple[int, int], tuple[redis.Redis, Settings, Spend]] = {}
"""One Spend (its scripts registered once) per store client and settings of the process."""


def spend_of(ctx: StepContext) -> Spend:
    client, settings = ctx.store.redis, ctx.settings
    held = _spends.get((id(client), id(settings)))
    if held is None:
        # The client and settings are held with it, so their ids are not reused meanwhile.
        held = _spends[(id(client), id(settings))] = (client, settings, Spend(client, settings))
    return held[2]


def _prompt_estimate(ctx: StepContext) -> int:
    """The round's prompt in tokens, estimated as the capacity manager does: its history,
    the agent's instructions and the tools' schemas."""
    agent = ctx.agent
    offered = list(all_tools().values()) if agent is None else agent.offered_tools()
    chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in ctx.history)
    chars += len(schemas_json(offered)) + (len(agent.system_message()) if agent else 0)
    return math.ceil(chars / CHARS_PER_TOKEN)


def limits_of(ctx: StepContext) -> tuple[int | None, float | None]:
    """The turn's own limits: its request's, lowered to its agent's."""
    agent = ctx.agent
    max_tokens = lower_limit(ctx.state.get("max_tokens"), agent.max_tokens if agent else None)
    max_usd = lower_limit(ctx.state.get("max_cost_usd"), agent.max_cost_usd if agent else None)
    return (None if max_tokens is None else int(max_tokens)), max_usd


def reserve_round(ctx: StepContext, round_no: int, model: str) -> None:
    """Reserve the round of `model` before it is admitted (once: a step that runs again
    finds it); raise BudgetExceeded when a budget cannot afford it."""
    reservation = str(round_no)
    if ctx.state.get("budget_reservation") == reservation:
        return
    s = ctx.settings
    prompt = _prompt_estimate(ctx)
    day = day_of(ctx.now)
    max_tokens, max_usd = limits_of(ctx)
    got = spend_of(ctx).reserve(
        owner=ctx.state.get("owner"),
        turn_id=ctx.turn_id,
        parents=list(ctx.state.get("budget_ancestors") or []),
        reservation=reservation,
        day=day,
        prompt_tokens=prompt,
        want=s.budget_completion_tokens,
        price=s.price_of(model),
        max_tokens=max_tokens,
        max_usd=max_usd,
    )
    if not isinstance(got, Reserved):
        when = resets_at(got.name, ctx.now) if got.scope == "key" else None
        raise BudgetExceeded(got.scope, got.name, got.spent, got.limit, when)
    ctx.stage(
        budget_reservation=reservation,
        budget_day=day,
        budget_cap=got.cap if got.bounded else None,
        budget_prompt=prompt,
    )


def round_usage(ctx: StepContext, result: LlmRoundResult, model: str) -> Usage:
    """What the round is charged: its usage (priced here if the stream worker did not), or,
    without one (a broken or aborted stream), its reservation's estimate."""
    price = ctx.settings.price_of(model)
    usage = result.message.usage if result.message is not None else None
    if usage is None:
        prompt = int(ctx.state.get("budget_prompt") or 0)
        completion = int(ctx.state.get("budget_cap") or ctx.settings.budget_completion_tokens)
        usage = Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            estimated=True,
        )
    if usage.cost_usd is None and price is not None:
        cost = cost_usd(price, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        usage = usage.model_copy(update={"cost_usd": cost})
    return usage


def settle_round(ctx: StepContext, round_no: int, result: LlmRoundResult, model: str) -> None:
    """Settle the round's reservation to its usage, and stage the turn's new totals (once:
    the totals move with the reservation's field, which a step that runs again finds gone)."""
    reservation = str(round_no)
    if ctx.state.get("budget_reservation") != reservation:
        return
    usage = round_usage(ctx, result, model)
    spend_of(ctx).settle(
        owner=ctx.state.get("owner"),
        turn_id=ctx.turn_id,
        parents=list(ctx.state.get("budget_ancestors") or []),
        reservation=reservation,
        day=str(ctx.state.get("budget_day") or day_of(ctx.now)),
        usage=usage,
        model=model,
        agent=ctx.state.get("agent"),
        first=round_no == 0,
    )
    st = ctx.state
    totals: TurnState = {
        "budget_reservation": None,
        "spent_prompt_tokens": int(st.get("spent_prompt_tokens") or 0) + usage.prompt_tokens,
        "spent_completion_tokens": int(st.get("spent_completion_tokens") or 0)
        + usage.completion_tokens,
        "spent_cached_tokens": int(st.get("spent_cached_tokens") or 0) + usage.cached_tokens,
        "spent_usd": float(st.get("spent_usd") or 0.0) + (usage.cost_usd or 0.0),
        "spent_estimated_rounds": int(st.get("spent_estimated_rounds") or 0) + int(usage.estimated),
    }
    ctx.stage(**totals)


def settle_left(ctx: StepContext, model: str) -> None:
    """At the turn's end: a round reserved and not settled (aborted mid-stream, or its turn
    ended before its result) is charged its reservation, the estimate."""
    reservation = ctx.state.get("budget_reservation")
    if reservation is not None:
        ended = LlmRoundResult(ok=False, error="the turn ended before the round's result")
        settle_round(ctx, int(reservation), ended, model)
