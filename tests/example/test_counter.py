"""A user's test of a one-tool agent: a scripted model, a fleet inside the test."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from agentq import TurnFailed
from agentq.testing import ScriptedModel, call, local_fleet, reply
from tests.example.counter import WordCount, counter

pytestmark = pytest.mark.integration


def test_the_counter_counts_with_its_tool() -> None:
    t0 = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    model = ScriptedModel([[call("word_count", text="a b")], reply('{"words": 2}')])
    with local_fleet(tools=["tests.example.counter"], model=model) as client:
        result = client.run(counter, "count: a b", timeout_s=30)
    assert isinstance(result.output, WordCount) and result.output.words == 2
    tool_message = next(m for m in result.history if m["role"] == "tool")
    assert tool_message["content"] == "2"
    assert len(model.requests) == 2
    took_s = time.monotonic() - t0
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, left
    # Ten seconds on an idle 2-core machine; a machine busy with other work gets more.
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert took_s <= 10 * busy, (took_s, busy)


def test_a_failure_shows_the_turns_events() -> None:
    model = ScriptedModel([reply("not json"), reply("still not json")])
    with (
        pytest.raises(TurnFailed) as caught,
        local_fleet(tools=["tests.example.counter"], model=model) as client,
    ):
        client.run(counter, "count: a b", timeout_s=30)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "turn_started" in notes and "turn_error" in notes and "invalid_output" in notes
