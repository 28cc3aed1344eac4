"""Which rounds take a reservation, and which are settled as they answer rather than by
the next round's RESERVE (one spend script a round): decisions on a step's state alone."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

from agentq.agents import Agent
from agentq.config import load_settings
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


def test_a_round_no_budget_bounds_takes_no_reservation() -> None:
    assert not spend.bounded(ctx())
    assert not spend.bounded(ctx(owner="unbudgeted-key"))
    assert spend.bounded(ctx(max_tokens=100))
    assert spend.bounded(ctx(max_cost_usd=1.0))
    assert spend.bounded(ctx(agent(max_tokens=50)))
    assert spend.bounded(ctx(owner="ci"))
    # A sub-agent: its parents' budgets are theirs to know.
    assert spend.bounded(ctx(budget_ancestors=["parent"]))


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
