"""The Lua state machines of the store, on fakeredis: first writer wins, answers close once."""

from __future__ import annotations

import fakeredis
import pytest

from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.interactions import Interactions
from agentq.models import InteractionAnswer, InteractionRequest, ToolCall
from agentq.results import cancelled_result, error_result
from agentq.store import TurnStore


@pytest.fixture()
def store() -> TurnStore:
    s = TurnStore(fakeredis.FakeRedis())
    s.create("t1", {"status": "running"}, [{"role": "user", "content": "x"}])
    return s


CALL = ToolCall(id="c1", name="echo")


def test_first_settle_wins_and_publishes_once(store: TurnStore) -> None:
    assert store.settle("t1", error_result(CALL, "first")) is True
    assert store.settle("t1", cancelled_result(CALL)) is False
    assert store.results("t1")["c1"].error == "first"
    finished = [e for e in store.bus.replay("t1") if e.type == "tool_finished"]
    assert len(finished) == 1 and finished[0].fields["status"] == "error"
    assert store.pop("t1", 0)["result"]["error"] == "first"  # type: ignore[index]
    assert store.pop("t1", 0) is None


def test_no_result_after_the_turn_is_over(store: TurnStore) -> None:
    store.close("t1", "aborted")
    assert store.settle("t1", error_result(CALL, "late")) is False
    assert store.results("t1") == {}


def test_start_refused_when_settled_or_cancelled(store: TurnStore) -> None:
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "x", "attempt": 1}
    event = {"call_id": "c2", "tool": "echo"}
    assert store.mark_started("t1", "c2", start, event) == 1
    store.settle("t1", error_result(ToolCall(id="c3", name="echo"), "done"))
    assert store.mark_started("t1", "c3", start, event) == 0
    store.request_cancel("t1", "user")
    assert store.mark_started("t1", "c4", start, event) == -1


def test_seq_increases_by_one_per_event(store: TurnStore) -> None:
    for i in range(5):
        store.bus.publish("t1", "llm_delta", text=str(i))
    assert [e.seq for e in store.bus.replay("t1")] == [1, 2, 3, 4, 5]


def test_lease_is_held_renewed_and_released_only_by_its_holder(store: TurnStore) -> None:
    assert store.acquire_lease("t1", "a", 5) is True
    assert store.acquire_lease("t1", "b", 5) is False
    assert store.renew_lease("t1", "b", 5) is False
    assert store.renew_lease("t1", "a", 5) is True
    store.release_lease("t1", "b")
    assert store.lease_holder("t1") == "a"
    store.release_lease("t1", "a")
    assert store.lease_holder("t1") is None


def test_an_interaction_closes_exactly_once(store: TurnStore) -> None:
    inter = Interactions(store)
    req = InteractionRequest(request_id="r1", kind="password", prompt="?", timeout_ms=1000)
    inter.open("t1", req)
    inter.answer("t1", "r1", InteractionAnswer(decision="approve", value="s3cret"))
    with pytest.raises(InteractionClosed) as info:
        inter.answer("t1", "r1", InteractionAnswer(decision="deny"))
    assert info.value.state == "answered"
    assert inter.expire("t1", "r1") is False  # the answer won the race
    inbox = store.pop("t1", 0)
    assert inbox is not None and "s3cret" not in str(inbox) and inbox["has_value"] is True
    with pytest.raises(InteractionNotFound):
        inter.answer("t1", "nope", InteractionAnswer(decision="approve"))


def test_a_timed_out_interaction_refuses_late_answers(store: TurnStore) -> None:
    inter = Interactions(store)
    inter.open(
        "t1", InteractionRequest(request_id="r2", kind="approval", prompt="?", timeout_ms=1000)
    )
    assert inter.expire("t1", "r2") is True
    with pytest.raises(InteractionClosed) as info:
        inter.answer("t1", "r2", InteractionAnswer(decision="approve"))
    assert info.value.state == "timed_out"
