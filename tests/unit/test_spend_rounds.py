"""Which rounds take a reservation: those of a turn any budget bounds, decided on a step's
state alone."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any, cast

from agentq.agents import Agent
from agentq.config import load_settings
from agentq.orchestrator import spend
from agentq.orchestrator.context import StepContext

SETTINGS = load_settings(key_budgets=json.dumps({"ci": {"tokens_per_day": 1000}}))


def ctx(agent: Agent | None = None, **state: Any) -> Any:
    return SimpleNamespace(agent=agent, state=state, settings=SETTINGS)


def agent(**kw: Any) -> Agent:
    return Agent(name=f"a_{uuid.uuid4().hex[:8]}", **kw)


def test_a_round_is_reserved_when_any_budget_bounds_its_turn() -> None:
    helper = agent(description="helps")
    assert not spend.budgeted(ctx())
    assert not spend.budgeted(ctx(owner="unbudgeted-key"))
    assert not spend.budgeted(ctx(agent(tools=[helper.as_tool(name="ask")])))
    # Its own (from its request or its agent), its key's, a parent's.
    assert spend.budgeted(ctx(max_tokens=100))
    assert spend.budgeted(ctx(max_cost_usd=1.0))
    assert spend.budgeted(ctx(agent(max_tokens=50)))
    assert spend.budgeted(ctx(owner="ci"))
    assert spend.budgeted(ctx(budget_ancestors=["parent"]))


def test_a_rounds_prompt_estimate_counts_the_instructions_it_is_sent_with() -> None:
    # A fork's edited instructions replace its agent's in its rounds, and in their estimate.
    state: Any = {"instructions": "x" * 40_000}
    edited = StepContext("t", cast(Any, None), cast(Any, None), SETTINGS, "", state, lock_ms=1)
    spend.reserve_round(edited, 0)  # no budget bounds it: nothing read from Redis
    assert edited.state["budget_prompt"] >= 10_000
