"""Agents of the integration tests, loaded by the session's workers (AGENTQ_TOOLS)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agentq.agents import Agent
from agentq.testing.tools import ask_quick, delete_file, echo, hang, sleep

echoer = Agent(
    name="t_echoer", instructions="You are t_echoer.", model="model-echoer", tools=[echo]
)
sleeper = Agent(
    name="t_sleeper",
    instructions="You are t_sleeper.",
    model="model-sleeper",
    tools=[sleep, hang],
    max_calls_per_turn=3,
)
waiter = Agent(name="t_waiter", instructions="You are t_waiter.", tools=[hang])


class Verdict(BaseModel):
    """The typed answer of t_judge."""

    answer: str
    confidence: float = Field(ge=0, le=1)


judge = Agent(name="t_judge", instructions="You are t_judge.", tools=[echo], output_type=Verdict)
asker = Agent(name="t_asker", instructions="You are t_asker.", tools=[delete_file, ask_quick])
boss = Agent(
    name="t_boss",
    instructions="You are t_boss.",
    tools=[
        echo,
        echoer.as_tool(name="ask_echoer", timeout_s=30, description="Ask the echoer."),
        sleeper.as_tool(name="ask_sleeper", timeout_s=2),
        waiter.as_tool(name="ask_waiter", timeout_s=60),
        judge.as_tool(name="ask_judge", timeout_s=30),
        asker.as_tool(name="ask_asker", timeout_s=60),
    ],
)
middle = Agent(
    name="t_middle",
    instructions="You are t_middle.",
    tools=[echoer.as_tool(name="ask_echoer", timeout_s=30)],
)
top = Agent(
    name="t_top",
    instructions="You are t_top.",
    tools=[middle.as_tool(name="ask_middle", timeout_s=60)],
)
watched = Agent(
    name="t_watched",
    instructions="You are t_watched.",
    tools=[echo],
    stream_idle_timeout_ms=1000,
    stream_duration_s=4,
)
