"""The turn's side of spend: before a round is sent, reserve what it may cost against the
turn's, its parents' and its key's budgets (the turn fails `budget_exceeded` when they
cannot afford it), settling its last round in the same script; when its result is in,
add its usage to the turn's totals. One spend script a round: a round that reserves
nothing (no budget, or only its turn's own, kept from the turn's state) is settled as it
answers; a reserved one by the next round's RESERVE, or at the turn's end. See
docs/spend.md and `agentq.state.spend`."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import redis

from agentq.config import Settings
from agentq.errors import BudgetExceeded
from agentq.llm.limits import CHARS_PER_TOKEN
from agentq.models import LlmRoundResult, Usage
from agentq.state.budget import (
    Budget,
    completion_cap,
    cost_usd,
    day_of,
    lower_limit,
    resets_at,
)
from agentq.state.spend import Reserved, Settlement, Spend
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


def reserves(ctx: StepContext) -> bool:
    """Whether the turn's rounds are reserved in Redis: they count against a budget other
    rounds spend meanwhile, its key's, a parent's (a sub-agent reserves whether its parents
    have limits or not: it cannot tell without reading them), or its own when it may start
    sub-agents. A turn whose one budget is its own, which its rounds alone spend, one at a
    time, keeps it from its state (`_own_cap`); a round no budget bounds reserves nothing."""
    agent = ctx.agent
    max_tokens, max_usd = limits_of(ctx)
    return (
        bool(ctx.state.get("budget_ancestors"))
        or (ctx.state.get("owner") or "") in ctx.settings.key_budgets
        or ((max_tokens is not None or max_usd is not None) and bool(agent and agent.agent_tools))
    )


def _own_cap(ctx: StepContext, prompt: int, model: str) -> int | None:
    """The completion a round of a turn bounded by its own limits alone may produce, by the
    same arithmetic as RESERVE, from the turn's totals (None: no limit counts); raise
    BudgetExceeded when they cannot afford it."""
    max_tokens, max_usd = limits_of(ctx)
    price = ctx.settings.price_of(model)
    st = ctx.state
    spent = int(st.get("spent_prompt_tokens") or 0) + int(st.get("spent_completion_tokens") or 0)
    budgets = []
    if max_tokens is not None:
        budgets.append(Budget("turn", "max_tokens", "tokens", max_tokens, spent))
    if max_usd is not None and price is not None:
        budgets.append(Budget("turn", "max_cost_usd", "usd", max_usd, st.get("spent_usd") or 0.0))
    if not budgets:
        return None
    decided = completion_cap(budgets, prompt, ctx.settings.budget_completion_tokens, price)
    if decided.exceeded is not None:
        b = decided.exceeded
        raise BudgetExceeded(b.scope, b.name, b.spent, b.limit, None)
    return decided.cap


def _pending(ctx: StepContext) -> Settlement | None:
    """The turn's last round, answered and not yet settled (its usage staged by
    `settle_round`), to be settled by the next script."""
    st = ctx.state
    used = st.get("budget_usage")
    reservation = st.get("budget_reservation")
    if used is None or reservation is None:
        return None
    usage = Usage.model_validate({f: v for f, v in used.items() if f not in ("round", "model")})
    return Settlement(
        round_no=int(reservation),
        reserved=_held(st),
        day=str(st.get("budget_day") or day_of(ctx.now)),
        usage=usage,
        model=str(used["model"]),
        agent=st.get("agent"),
    )


def _held(st: TurnState) -> bool:
    """Whether the round in `budget_reservation` took a reservation: unless recorded as
    not (a round sent by an older version, which reserved every round, did)."""
    return st.get("budget_held") is not False


_SETTLED: TurnState = {"budget_reservation": None, "budget_usage": None, "budget_held": None}
"""The state of a turn with no round to settle."""


def _args(ctx: StepContext) -> dict[str, Any]:
    return {
        "owner": ctx.state.get("owner"),
        "turn_id": ctx.turn_id,
        "parents": list(ctx.state.get("budget_ancestors") or []),
    }


def reserve_round(ctx: StepContext, round_no: int, model: str) -> None:
    """Reserve the round of `model` before it is admitted, settling the turn's last round
    in the same script (once: a step that runs again finds it reserved); raise
    BudgetExceeded when a budget cannot afford it. A round no budget bounds is only
    recorded as sent: its usage is added once it answers."""
    reservation = str(round_no)
    if ctx.state.get("budget_reservation") == reservation:
        return
    s = ctx.settings
    prompt = _prompt_estimate(ctx)
    day = day_of(ctx.now)
    pending = _pending(ctx)
    sent: TurnState = {
        "budget_reservation": reservation,
        "budget_day": day,
        "budget_prompt": prompt,
        "budget_usage": None,
    }
    if not reserves(ctx):
        if pending is not None:  # the turn's budgets changed (its key's, by a restart)
            spend_of(ctx).settle(**_args(ctx), settle=pending)
            ctx.stage(**_SETTLED)
        sent["budget_held"], sent["budget_cap"] = False, _own_cap(ctx, prompt, model)
        ctx.stage(**sent)
        return
    max_tokens, max_usd = limits_of(ctx)
    got = spend_of(ctx).reserve(
        **_args(ctx),
        reservation=reservation,
        day=day,
        prompt_tokens=prompt,
        want=s.budget_completion_tokens,
        price=s.price_of(model),
        max_tokens=max_tokens,
        max_usd=max_usd,
        settle=pending,
    )
    if not isinstance(got, Reserved):
        # The last round was settled all the same: the turn's end finds nothing to settle.
        ctx.stage(**_SETTLED)
        when = resets_at(got.name, ctx.now) if got.scope == "key" else None
        raise BudgetExceeded(got.scope, got.name, got.spent, got.limit, when)
    sent["budget_held"], sent["budget_cap"] = True, got.cap if got.bounded else None
    ctx.stage(**sent)


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


def _goes_on(ctx: StepContext, result: LlmRoundResult) -> bool:
    """Whether the turn sends another round after this one, whose RESERVE can settle it:
    the round asks for tools, none of which starts a sub-agent (a child's rounds count
    against this turn's budget, so its reservation must be down to its usage first)."""
    calls = result.message.tool_calls if result.ok and result.message is not None else ()
    agents = ctx.agent.agent_tools if ctx.agent is not None else {}
    return bool(calls) and not any(c.name in agents for c in calls)


def settle_round(ctx: StepContext, round_no: int, result: LlmRoundResult, model: str) -> None:
    """Count the answered round: stage the turn's new totals and, as the step writes
    anyway, the round's usage. Its reservation is settled to that usage by the next
    round's RESERVE (one script a round), or now when no such round may come, or no
    reservation was taken. Once: a step that runs again finds the round counted."""
    reservation = str(round_no)
    st = ctx.state
    if st.get("budget_reservation") != reservation or st.get("budget_usage") is not None:
        return
    usage = round_usage(ctx, result, model)
    totals: TurnState = {
        "spent_prompt_tokens": int(st.get("spent_prompt_tokens") or 0) + usage.prompt_tokens,
        "spent_completion_tokens": int(st.get("spent_completion_tokens") or 0)
        + usage.completion_tokens,
        "spent_cached_tokens": int(st.get("spent_cached_tokens") or 0) + usage.cached_tokens,
        "spent_usd": float(st.get("spent_usd") or 0.0) + (usage.cost_usd or 0.0),
        "spent_estimated_rounds": int(st.get("spent_estimated_rounds") or 0) + int(usage.estimated),
    }
    if _held(st) and _goes_on(ctx, result):
        used = {"round": round_no, "model": model, **usage.model_dump(exclude_none=True)}
        totals["budget_usage"] = used
        ctx.stage(**totals)
        return
    max_tokens, max_usd = limits_of(ctx)
    settle = Settlement(
        round_no=round_no,
        reserved=_held(st),
        day=str(st.get("budget_day") or day_of(ctx.now)),
        usage=usage,
        model=model,
        agent=st.get("agent"),
        max_tokens=max_tokens,
        max_usd=max_usd,
    )
    spend_of(ctx).settle(**_args(ctx), settle=settle)
    totals.update(_SETTLED)
    ctx.stage(**totals)


def settle_left(ctx: StepContext, model: str) -> None:
    """At the turn's end: its last round's usage, if not settled yet; a round sent and not
    answered (aborted mid-stream, or its turn ended before its result) is charged its
    estimate."""
    if ctx.state.get("budget_reservation") is None:
        return
    pending = _pending(ctx)
    if pending is not None:
        spend_of(ctx).settle(**_args(ctx), settle=pending)
        ctx.stage(**_SETTLED)
        return
    ended = LlmRoundResult(ok=False, error="the turn ended before the round's result")
    settle_round(ctx, int(ctx.state["budget_reservation"] or 0), ended, model)
