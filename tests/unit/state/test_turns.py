"""The turn's end: once, fenced, nothing after it (state/turns.py)."""

from __future__ import annotations

from agentq import constants as k
from agentq.models import TurnStatus
from agentq.state.base import active_turns
from agentq.state.steplock import Released
from agentq.state.store import TurnStore
from agentq.state.turns import Closed
from agentq.tools.results import error_result
from tests.unit.state.support import CALL, lock


def test_nothing_after_the_turn_is_over(store: TurnStore) -> None:
    assert store.close("t1", TurnStatus.ABORTED, "turn_aborted", {"reason": "user"}) == Closed.ENDED
    assert store.close("t1", TurnStatus.ERROR, "turn_error", {"code": "x"}) == Closed.ENDED_ALREADY
    assert store.settle("t1", error_result(CALL, "late")) is False
    assert store.results("t1") == {}
    assert store.bus.publish("t1", "llm_delta", text="late") == 0
    assert store.wake("t1") is False
    types = [e.type for e in store.bus.replay("t1")]
    assert types == ["turn_aborted"]
    assert store.state("t1")["status"] == "aborted"  # type: ignore[index]
    assert store.redis.ttl(k.turn_key("t1")) > 0
    assert store.redis.zscore(k.WAKEUPS, "t1") is None
    # A late step of the ended turn (one delivered after the end) lets go of it without
    # putting it back among the open turns, whose set the wakeups are.
    assert store.lock_step("t1", "late", 5000)
    assert store.release_step("t1", "late", None, 5000) == Released.RELEASED
    assert store.redis.zscore(k.WAKEUPS, "t1") is None
    assert active_turns(store.redis) == []


def test_a_step_ends_the_turn_with_its_last_messages_only_while_it_holds_the_lock(
    store: TurnStore,
) -> None:
    store.create("t2", {"status": "running"}, [{"role": "user", "content": "hi"}])
    assert store.begin_step("t2", "mine", 10_000) is not None
    last = [{"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    # A step whose lock lapsed and was taken by another writes nothing, not even the end.
    lock(store, "t2", "theirs")
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last)
        == Closed.LOST
    )
    assert store.history("t2") == [{"role": "user", "content": "hi"}]
    assert store.status("t2") == "running" and not store.bus.replay("t2")
    lock(store, "t2", "mine")
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last)
        == Closed.ENDED
    )
    assert store.history("t2") == [{"role": "user", "content": "hi"}, *last]
    assert store.status("t2") == "finished"
    assert [e.type for e in store.bus.replay("t2")] == ["turn_finished"]
    # Ended: a second end (a retry after a failover) appends nothing twice.
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last)
        == Closed.ENDED_ALREADY
    )
    assert len(store.history("t2")) == 2
