"""The event bus: seq, and many turns published in one call (events/bus.py)."""

from __future__ import annotations

from agentq.models import TurnStatus
from agentq.state.store import TurnStore
from agentq.state.turns import Closed
from tests.unit.state.support import publish_many


def test_seq_increases_by_one_per_event(store: TurnStore) -> None:
    for i in range(5):
        store.bus.publish("t1", "llm_delta", text=str(i))
    assert [e.seq for e in store.bus.replay("t1")] == [1, 2, 3, 4, 5]


def test_publish_many_keeps_each_turns_order_and_skips_ended_turns(store: TurnStore) -> None:
    from agentq.events import bus as bus_module

    store.create("t2", {"status": "running"}, [{"role": "user", "content": "y"}])
    store.create("t3", {"status": "running"}, [{"role": "user", "content": "z"}])
    store.bus.publish("t1", "llm_started")
    assert store.close("t3", TurnStatus.ABORTED, "turn_aborted", {"reason": "user"}) == Closed.ENDED
    n = bus_module.PUBLISH_MANY_EVENTS + 20  # more than one script call's worth
    publish_many(
        store,
        {
            "t1": [("llm_delta", {"text": str(i)}) for i in range(n)],
            "t3": [("llm_delta", {"text": "late"})],
            "t2": [("llm_delta", {"text": "a"}), ("llm_finished", {})],
        },
    )
    t1 = store.bus.replay("t1")
    assert [e.seq for e in t1] == list(range(1, n + 2))
    assert [e.fields.get("text") for e in t1[1:]] == [str(i) for i in range(n)]
    assert [(e.seq, e.type) for e in store.bus.replay("t2")] == [
        (1, "llm_delta"),
        (2, "llm_finished"),
    ]
    assert [e.type for e in store.bus.replay("t3")] == ["turn_aborted"]
