"""The store's writes count the events they publish in the fleet's metrics, once."""

from __future__ import annotations

import pytest

from agentq.models import TurnStatus
from agentq.state.store import TurnStore
from agentq.state.turns import Closed
from agentq.tools.results import error_result
from tests.unit.state.support import CALL, publish_many


def test_the_writes_that_publish_counted_events_count_them_once(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentq.state import base
    from agentq.telemetry.fleetcounts import FleetCounts, field_of, read_counts

    counts = FleetCounts()
    monkeypatch.setattr(base, "fleet_counts", counts)
    store.bus.publish("t1", "llm_queued", model="m", position=1, first=True)
    store.bus.publish("t1", "llm_started", model="m", queued_ms=5)
    store.bus.publish("t1", "llm_started", model="m", round_no=1)  # did not wait
    finished = {"code": "ETIMEDOUT", "error": "idle"}
    publish_many(store, {"t1": [("llm_delta", {"text": "a"}), ("llm_finished", finished)]})
    store.bus.publish("t1", "tool_progress", message="half")
    assert store.settle("t1", error_result(CALL, "boom")) is True
    assert store.settle("t1", error_result(CALL, "again")) is False  # not published
    assert store.close("t1", TurnStatus.FINISHED, "turn_finished", {}) == Closed.ENDED
    # Refused after the end: nothing published, nothing counted.
    assert store.bus.publish("t1", "turn_error", code="x") == 0
    publish_many(store, {"t1": [("llm_retry", {"code": "ETIMEDOUT"})]})
    counts.flush(store.redis)
    got = read_counts(store.redis)
    assert got.pop(field_of("llm_rounds_queued", ("m",))) == 1
    assert got.pop(field_of("llm_queue_wait_seconds", ("m",), "0")) == 1  # under 0.1 s
    assert got.pop(field_of("llm_queue_wait_seconds", ("m",), "sum")) == pytest.approx(0.005)
    assert got.pop(field_of("watchdog_trips", ())) == 1
    assert got.pop(field_of("tool_results", ("echo", "error"))) == 1
    assert got.pop(field_of("turns_ended", ("finished",))) == 1
    assert got == {}
