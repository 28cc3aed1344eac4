"""The turn's side of spend (docs/spend.md): a round under a budget is reserved against the
turn's, its parents' and its key's budgets before it is sent, then settled to its usage."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, cast

import redis

from agentq.config import Settings
from agentq.llm.limits import CHARS_PER_TOKEN
from agentq.models import LlmRoundResult, Usage
from agentq.state.budget import charged, day_of, lower_limit
from agentq.state.spend import Settlement, Spend
from agentq.state.turn_state import TurnState
from agentq.tools.registry import schemas_json

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


SPENT = {
    "spent_prompt_tokens": "prompt_tokens",
    "spent_completion_tokens": "completion_tokens",
    "spent_cached_tokens": "cached_tokens",
    "spent_usd": "cost_usd",
    "spent_estimated_rounds": "estimated",
}
"""A turn's spend so far (fields of its state), each the sum of a Usage field over its rounds."""


def limits_of(ctx: StepContext) -> tuple[int | None, float | None]:
    """The turn's own limits: its request's, lowered to its agent's."""
    agent = ctx.agent
    max_tokens = lower_limit(ctx.state.get("max_tokens"), agent.max_tokens if agent else None)
    max_usd = lower_limit(ctx.state.get("max_cost_usd"), agent.max_cost_usd if agent else None)
    return (None if max_tokens is None else int(max_tokens)), max_usd


def budgeted(ctx: StepContext) -> bool:
    """Whether a budget bounds the turn's rounds: its own, its key's, or a parent's (a
    sub-agent reserves always: it cannot tell its parents' limits without reading them)."""
    max_tokens, max_usd = limits_of(ctx)
    return (
        max_tokens is not None
        or max_usd is not None
        or bool(ctx.state.get("budget_ancestors"))
        or (ctx.state.get("owner") or "") in ctx.settings.key_budgets
    )


def carry_spent(client: redis.Redis, settings: Settings, turn_id: str, state: TurnState) -> None:
    """A retry's spend in Redis (which its RESERVE reads) starts at its source's `spent_*`."""
    carried = Usage.model_validate(
        {u: state.get(f) or 0 for f, u in SPENT.items() if u != "estimated"}
    )
    if carried.prompt_tokens or carried.completion_tokens or carried.cost_usd:
        Spend(client, settings).carry(state.get("owner"), turn_id, carried)


def _args(ctx: StepContext) -> dict[str, Any]:
    return {
        "owner": ctx.state.get("owner"),
        "turn_id": ctx.turn_id,
        "parents": list(ctx.state.get("budget_ancestors") or []),
    }


def reserve_round(ctx: StepContext, round_no: int) -> None:
    """Record the round as sent, reserved under a budget first (once), else BudgetExceeded."""
    reservation = str(round_no)
    if ctx.state.get("budget_reservation") == reservation:
        return
    # The round's prompt in tokens, estimated as the capacity manager does.
    chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in ctx.history)
    chars += len(schemas_json(ctx.offered_tools())) + len(ctx.instructions)
    prompt, day, cap = math.ceil(chars / CHARS_PER_TOKEN), day_of(ctx.now), None
    if budgeted(ctx):
        max_tokens, max_usd = limits_of(ctx)
        cap = Spend(ctx.store.redis, ctx.settings).reserve(
            **_args(ctx),
            reservation=reservation,
            day=day,
            prompt_tokens=prompt,
            want=ctx.settings.budget_completion_tokens,
            price=ctx.settings.llm_prices.get(ctx.model),
            max_tokens=max_tokens,
            max_usd=max_usd,
        )
    ctx.stage(budget_reservation=reservation, budget_day=day, budget_prompt=prompt, budget_cap=cap)


def round_usage(ctx: StepContext, result: LlmRoundResult, model: str) -> Usage:
    """The round's charge: its usage (priced here if need be), else its reservation's estimate."""
    usage = result.message.usage if result.message is not None else None
    prompt = int(ctx.state.get("budget_prompt") or 0)
    completion = int(ctx.state.get("budget_cap") or ctx.settings.budget_completion_tokens)
    return charged(usage, prompt, completion, ctx.settings.llm_prices.get(model))


def settle_round(ctx: StepContext, round_no: int, result: LlmRoundResult) -> None:
    """Settle the answered round in Redis (its reservation replaced by its usage) and stage
    the turn's totals; once (a step that runs again finds it settled, in state or Redis)."""
    st = ctx.state
    if st.get("budget_reservation") != str(round_no):
        return
    usage = round_usage(ctx, result, ctx.model)
    day = str(st.get("budget_day") or day_of(ctx.now))
    settle = Settlement(round_no, day, usage, ctx.model, st.get("agent"))
    Spend(ctx.store.redis, ctx.settings).settle(**_args(ctx), settle=settle)
    was = cast(dict[str, Any], st)
    spent = {f: (was.get(f) or 0) + (getattr(usage, u) or 0) for f, u in SPENT.items()}
    ctx.stage(**cast(TurnState, {**spent, "budget_reservation": None}))


def settle_left(ctx: StepContext) -> None:
    """At the turn's end: a round sent and not answered is settled at its estimate."""
    reservation = ctx.state.get("budget_reservation")
    if reservation is not None:
        ended = LlmRoundResult(ok=False, error="the turn ended before the round's result")
        settle_round(ctx, int(reservation), ended)
