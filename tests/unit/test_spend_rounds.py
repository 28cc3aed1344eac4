"""Which rounds take a reservation, and which are settled as they answer rather than by
the next round's RESERVE (one spend script a round): decisions on a step's state alone."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from agentq.agents import Agent
from agentq.config import load_settings
from agentq.errors import BudgetExceeded
from agentq.models import AssistantMessage, LlmRoundResult, ToolCall
from agentq.orchestrator import spend

SETTINGS = load_settings(key_budgets=json.dumps({"ci": {"tokens_per_day": 1000}}))


def ctx(agent: Agent | None = None, **state: Any) -> Any:
    return SimpleNamespace(agent=agent, state=state, settings=SETTINGS)


def answer(*tools: str) -> LlmRoundResult:
    calls = tuple(ToolCall(id=f"c{i}", name=n, arguments="{}") for i, n in enumerate(tools))
    return LlmRoundResult(ok=True, message=AssistantMessage(content="", tool_calls=calls))


def agent(**kw: Any) -> Agent:
    return Agent(name=f"a_{uuid.uuid4().hex[:8]}", **kw)


def test_a_round_is_reserved_in_redis_when_others_spend_its_budget() -> None:
    helper = agent(description="helps")
    assert not spend.reserves(ctx())
    assert not spend.reserves(ctx(owner="unbudgeted-key"))
    # The turn's own budget, which only its rounds spend, one at a time: kept in its state.
    assert not spend.reserves(ctx(max_tokens=100))
    assert not spend.reserves(ctx(agent(max_tokens=50)))
    assert not spend.reserves(ctx(agent(tools=[helper.as_tool(name="ask")])))
    # Spent meanwhile by others: the key's turns, a parent's other children, its own.
    assert spend.reserves(ctx(owner="ci"))
    assert spend.reserves(ctx(budget_ancestors=["parent"]))
    assert spend.reserves(ctx(agent(tools=[helper.as_tool(name="ask")]), max_cost_usd=1.0))


def test_a_turns_own_budget_caps_its_round_from_its_totals() -> None:
    assert spend._own_cap(ctx(), prompt=100, model="m") is None
    want = SETTINGS.budget_completion_tokens
    assert spend._own_cap(ctx(max_tokens=10**6), prompt=100, model="m") == want
    spent = {"spent_prompt_tokens": 600, "spent_completion_tokens": 100}
    assert spend._own_cap(ctx(max_tokens=1000, **spent), prompt=200, model="m") == 100
    with pytest.raises(BudgetExceeded) as refused:
        spend._own_cap(ctx(max_tokens=1000, **spent), prompt=295, model="m")
    assert (refused.value.scope, refused.value.budget) == ("turn", "max_tokens")
    assert (refused.value.spent, refused.value.limit) == (700, 1000)


def test_a_round_asking_for_tools_is_settled_by_the_next_rounds_reserve() -> None:
    assert spend._goes_on(ctx(), answer("echo"))
    # The turn ends with an answer, or the round failed: nobody would fold it in.
    assert not spend._goes_on(ctx(), answer())
    assert not spend._goes_on(ctx(), LlmRoundResult(ok=False, error="broke"))


def test_a_round_that_starts_sub_agents_is_settled_at_once() -> None:
    helper = agent(description="helps")
    boss = agent(tools=["echo", helper.as_tool(name="ask_helper")])
    assert spend._goes_on(ctx(boss), answer("echo"))
    # Its child's rounds count against this turn: its reservation goes down to its usage.
    assert not spend._goes_on(ctx(boss), answer("echo", "ask_helper"))


def test_a_round_an_older_version_sent_counts_as_reserved() -> None:
    assert spend._held({"budget_reservation": "3"})
    assert spend._held({"budget_reservation": "3", "budget_held": True})
    assert not spend._held({"budget_reservation": "3", "budget_held": False})
