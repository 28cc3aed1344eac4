"""`Client.run` and `Client.start` through real workers: one call to a typed result, a
handle for the rest, and a typed error for every turn that does not finish."""

from __future__ import annotations

import pytest

from agentq import (
    Client,
    HeadlessInteraction,
    Turn,
    TurnAborted,
    TurnFailed,
    TurnResult,
    TurnTimeout,
)
from agentq.errors import AgentqError
from agentq.events import ToolFinished, ToolStarted, TurnEnded, TurnFinished
from agentq.testing.openai_server import Round
from tests.agents_under_test import Verdict, judge
from tests.helpers import calls, script

pytestmark = pytest.mark.integration


def test_run_answers_the_final_text_usage_and_history(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server, Round(tool_calls=calls(("echo", {"text": "hi"}))), Round(text="said hi")
    )
    result = client.run(None, key, timeout_s=30)
    assert isinstance(result, TurnResult)
    assert (result.status, result.text, result.output) == ("finished", "said hi", None)
    assert result.usage.total_tokens > 0
    assert [m["role"] for m in result.history] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("agent", [judge, "t_judge"], ids=["agent", "name"])
def test_run_validates_the_output_as_the_agents_type(
    fleet, llm_server, client: Client, agent: object
) -> None:
    key = script(llm_server, Round(text='{"answer": "yes", "confidence": 0.5}'))
    result = client.run(agent, key, timeout_s=30)  # type: ignore[arg-type]
    assert result.output == Verdict(answer="yes", confidence=0.5)


def test_a_failed_turn_raises_turn_failed_with_its_code(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(text="no json"), Round(text="still none"))
    with pytest.raises(TurnFailed) as err:
        client.run("t_judge", key, timeout_s=30)
    assert err.value.error_code == "invalid_output"
    assert isinstance(err.value, AgentqError) and err.value.turn_id


def test_a_headless_turn_that_must_ask_raises_headless_interaction(
    fleet, llm_server, client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("delete_file", {"path": "/x"}))))
    with pytest.raises(HeadlessInteraction) as err:
        client.run("t_asker", key, headless=True, timeout_s=30)
    assert err.value.kind == "approval" and err.value.request_id


def test_start_gives_a_handle_with_typed_events_abort_and_result(
    fleet, llm_server, client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 30}))))
    turn = client.start(None, key)
    assert isinstance(turn, Turn) and turn.token
    with pytest.raises(TurnTimeout) as late:
        turn.result(timeout_s=0.2)
    assert isinstance(late.value, TimeoutError) and isinstance(late.value, AgentqError)
    for ev in turn.events():
        if isinstance(ev, ToolStarted):
            turn.abort()
    assert isinstance(ev, TurnEnded) and ev.ends_turn and ev.type == "turn_aborted"
    with pytest.raises(TurnAborted) as err:
        turn.result(timeout_s=10)
    assert err.value.reason == "user"


def test_events_stop_at_the_turns_own_end(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("echo", {"text": "x"}))), Round(text="ok"))
    events = list(client.start(None, key).events())
    assert [type(e) for e in events if isinstance(e, ToolFinished)] == [ToolFinished]
    assert isinstance(events[-1], TurnFinished) and events[-1].content == "ok"
    assert sum(e.ends_turn for e in events) == 1
