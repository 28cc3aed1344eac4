"""Demo agents: a lead that hands research to a researcher, called as a tool.

Load with AGENTQ_TOOLS=agentq.testing.tools,agentq.testing.agents (what `agentq dev`
does); the scripted demo model (`--script demo`) answers each by its instructions:

    agentq dev --once --agent lead
"""

from __future__ import annotations

from typing import Any

from agentq.agents import Agent
from agentq.testing.tools import echo, sleep

RESEARCHER_INSTRUCTIONS = "You are the researcher. Gather facts with your tools, then report them."
LEAD_INSTRUCTIONS = "You are the lead. Hand research to the researcher, then answer the user."

researcher = Agent(
    name="researcher",
    instructions=RESEARCHER_INSTRUCTIONS,
    description="Researches a question with its tools and reports the facts it found.",
    tools=[echo, sleep],
    max_calls_per_turn=10,
)

lead = Agent(
    name="lead",
    instructions=LEAD_INSTRUCTIONS,
    tools=[echo, researcher.as_tool(timeout_s=60)],
)

asker = Agent(
    name="asker",
    instructions="You ask the user what you need to know (ask_user), then answer.",
    tools=[echo],
    ask_user=True,
)


def demo_scripts() -> dict[str, list[dict[str, Any]]]:
    """The scripted model's rounds for these agents, keyed by their instructions, in the
    script file format of agentq.testing.openai_server (which validates them)."""
    return {
        f"system:{LEAD_INSTRUCTIONS}": [
            dict(
                text="Asking the researcher.",
                tool_calls=[dict(name="researcher", arguments={"prompt": "What is agentq?"})],
                chunk_size=6,
                chunk_delay_ms=20,
            ),
            dict(
                text="The researcher found that agentq runs agent turns as Celery jobs.",
                chunk_size=6,
                chunk_delay_ms=20,
            ),
        ],
        f"system:{RESEARCHER_INSTRUCTIONS}": [
            dict(
                text="Looking it up.",
                tool_calls=[
                    dict(name="echo", arguments={"text": "agentq: turns as Celery jobs"}),
                    dict(name="sleep", arguments={"seconds": 1}),
                ],
            ),
            dict(text="agentq runs LLM agent turns as background jobs on a Celery fleet."),
        ],
    }
