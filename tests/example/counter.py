"""A user's app as the README writes one: a tool, an agent with a typed answer."""

from __future__ import annotations

from pydantic import BaseModel

from agentq import Agent, tool


@tool(timeout_s=10, budget_s=2)
def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


class WordCount(BaseModel):
    words: int


counter = Agent(
    name="word_counter",
    instructions="Count the words with word_count, then answer.",
    tools=[word_count],
    output_type=WordCount,
)
