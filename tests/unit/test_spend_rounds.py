"""Which rounds take a reservation: those of a turn any budget bounds, decided on a step's
state alone."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

from agentq.agents import Agent
from agentq.config import load_settings
from agentq.orchestrator import spend

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
