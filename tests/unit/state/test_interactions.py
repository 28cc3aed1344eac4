"""Interaction requests close exactly once (state/interactions.py)."""

from __future__ import annotations

import pytest

from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.models import InteractionAnswer, InteractionRequest
from agentq.state.store import TurnStore


def test_an_interaction_closes_exactly_once(store: TurnStore) -> None:
    req = InteractionRequest(request_id="r1", kind="password", prompt="?", timeout_ms=1000)
    store.open_interaction("t1", req)
    store.answer_interaction("t1", "r1", InteractionAnswer(decision="approve", value="s3cret"))
    with pytest.raises(InteractionClosed) as info:
        store.answer_interaction("t1", "r1", InteractionAnswer(decision="deny"))
    assert info.value.state == "answered"
    assert store.expire_interaction("t1", "r1") is False  # the answer won the race
    answered = [e for e in store.bus.replay("t1") if e.type == "interaction_answered"]
    assert len(answered) == 1 and "s3cret" not in answered[0].model_dump_json()
    with pytest.raises(InteractionNotFound):
        store.answer_interaction("t1", "nope", InteractionAnswer(decision="approve"))


def test_a_timed_out_interaction_refuses_late_answers(store: TurnStore) -> None:
    store.open_interaction(
        "t1", InteractionRequest(request_id="r2", kind="approval", prompt="?", timeout_ms=1000)
    )
    assert store.expire_interaction("t1", "r2") is True
    with pytest.raises(InteractionClosed) as info:
        store.answer_interaction("t1", "r2", InteractionAnswer(decision="approve"))
    assert info.value.state == "timed_out"
