"""Interaction requests close exactly once (state/interactions.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.models import InteractionAnswer, InteractionRequest
from agentq.state.store import TurnStore
from agentq.tools.context import ToolContext


def test_an_interaction_closes_exactly_once(store: TurnStore) -> None:
    req = InteractionRequest(request_id="r1", kind="password", prompt="?", timeout_ms=1000)
    store.open_interaction("t1", req)
    store.answer_interaction("t1", "r1", InteractionAnswer(decision="approve", value="s3cret"))
    with pytest.raises(InteractionClosed) as info:
        store.answer_interaction("t1", "r1", InteractionAnswer(decision="deny"))
    assert info.value.state == "answered"
    assert store.expire_interaction("t1", req) == "answered"  # the answer won the race
    answered = [e for e in store.bus.replay("t1") if e.type == "interaction_answered"]
    assert len(answered) == 1 and "s3cret" not in answered[0].model_dump_json()
    with pytest.raises(InteractionNotFound):
        store.answer_interaction("t1", "nope", InteractionAnswer(decision="approve"))


def test_a_timed_out_interaction_refuses_late_answers(store: TurnStore) -> None:
    req = InteractionRequest(request_id="r2", kind="approval", prompt="?", timeout_ms=1000)
    store.open_interaction("t1", req)
    assert store.expire_interaction("t1", req) == "timed_out"
    with pytest.raises(InteractionClosed) as info:
        store.answer_interaction("t1", "r2", InteractionAnswer(decision="approve"))
    assert info.value.state == "timed_out"


def test_an_mcp_question_whose_turn_ended_while_it_waited_is_declined(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentq.mcp import link

    opened = store.open_interaction

    def open_then_end(turn_id: str, req: InteractionRequest) -> None:
        opened(turn_id, req)
        store.update(turn_id, status="aborted")  # the turn ends while the question waits

    monkeypatch.setattr(link, "get_store", lambda: store)
    monkeypatch.setattr(store, "open_interaction", open_then_end)
    caller = ToolContext(
        turn_id="t1",
        call_id="c1",
        tool="mcp__ask",
        started_at=time.time(),
        timeout_s=1.2,
        soft_timeout_s=None,
    )
    answer: list[tuple[str, Any]] = []
    asking = threading.Thread(target=lambda: answer.append(link.ask(caller, "?", {})), daemon=True)
    asking.start()
    asking.join(timeout=5)
    # Its close found the turn over: the question is not closed again and again.
    assert answer == [("decline", None)]
