"""Tool calls: dispatch records, starts, and exactly one result each (state/calls.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agentq import constants as k
from agentq.models import ToolCall, TurnStatus
from agentq.state import base
from agentq.state.calls import Started
from agentq.state.store import TurnStore
from agentq.tools.results import cancelled_result, error_result
from tests.unit.state.support import CALL, Woken, dirty, unsettled


def test_first_settle_wins_publishes_once_and_wakes_the_turn(store: TurnStore) -> None:
    store.stepper = woken = Woken()
    assert store.settle("t1", error_result(CALL, "first")) is True
    assert store.settle("t1", cancelled_result(CALL)) is False
    assert store.results("t1")["c1"].error == "first"
    finished = [e for e in store.bus.replay("t1") if e.type == "tool_finished"]
    assert len(finished) == 1 and finished[0].fields["status"] == "error"
    assert woken == ["t1"]  # the losing settle wakes nobody
    assert dirty(store, "t1")
    # The backstop: a sweeper steps the turn soon even if the step message was lost.
    assert store.redis.zscore(k.WAKEUPS, "t1") is not None


def test_start_refused_when_settled_or_cancelled(store: TurnStore) -> None:
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "x", "attempt": 1}
    event = {"call_id": "c2", "tool": "echo"}
    # Started beside another call in flight (3 would say it is the batch's only one).
    store.record_dispatch("t1", {"c2": {"task_id": "x"}, "c5": {"task_id": "y"}})
    assert store.mark_started("t1", "c2", start, event) == Started.STARTED
    store.settle("t1", error_result(ToolCall(id="c3", name="echo"), "done"))
    assert store.mark_started("t1", "c3", start, event) == Started.SETTLED
    store.flag_cancel("t1", "user")
    assert store.mark_started("t1", "c4", start, event) == Started.CANCELLED


def test_a_dead_workers_turns_are_found_by_their_start_records(store: TurnStore) -> None:
    store.create("t2", {"status": "running"}, [])
    store.create("t3", {"status": "running"}, [])
    event = {"call_id": "c", "tool": "echo"}
    start = {"started_at": 1.0, "pid": 1, "task_id": "x", "attempt": 1, "heartbeat": True}
    store.mark_started("t1", "c1", {**start, "worker": "w1"}, event)
    store.mark_started("t2", "c1", {**start, "worker": "w2"}, event)
    # Not watched by its worker's heartbeat: the call's own deadline tells.
    store.mark_started("t3", "c1", {**start, "worker": "w1", "heartbeat": False}, event)
    assert store.turns_running_on("w1", batch=1) == ["t1"]
    assert store.turns_running_on("w2") == ["t2"]
    assert store.turns_running_on("w") == []
    # A turn that ended is not open: not read.
    store.close("t1", TurnStatus.FINISHED, "turn_finished", {})
    assert store.turns_running_on("w1") == []


def test_only_the_settle_that_completes_the_batch_in_flight_wakes_the_turn(
    store: TurnStore,
) -> None:
    c2 = ToolCall(id="c2", name="echo")
    store.record_dispatch("t1", {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}})
    assert unsettled(store, "t1") == 2
    assert store.settle("t1", error_result(CALL, "first"))
    assert not dirty(store, "t1") and unsettled(store, "t1") == 1
    assert store.settle("t1", error_result(c2, "last"))
    assert dirty(store, "t1") and unsettled(store, "t1") == 0


def test_a_turns_call_records_are_fields_of_its_state_that_state_reads_leave_out(
    store: TurnStore,
) -> None:
    store.record_dispatch("t1", {"c1": {"task_id": "a"}})
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "a", "attempt": 1}
    assert (
        store.mark_started("t1", "c1", start, {"call_id": "c1", "tool": "echo"}) == Started.STARTED
    )
    assert store.settle("t1", error_result(CALL, "one"), wake=False)
    fields = {f.decode() for f in store.redis.hkeys(k.turn_key("t1"))}
    assert {k.DISPATCHED + "c1", k.STARTED + "c1", k.SETTLED + "c1"} <= fields
    assert store.redis.keys("*:calls") == []
    state = store.state("t1")
    assert state is not None and state["status"] == "running"
    assert not [f for f in state if k.is_record(f)]
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.state is not None
    assert not [f for f in view.state if k.is_record(f)]
    assert (
        store.results("t1")["c1"].error == "one" and store.call_progress("t1")[0]["c1"]["pid"] == 1
    )


def _failover_on_first_run(
    store: TurnStore, lost: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """Replicas acknowledge no run but the retries: the first run's master is demoted
    (`lost` does to the state what the failover did). Returns the WAIT counts given."""
    store.replicas_acked = 1
    real = base.run_pipeline
    given: list[int] = []

    def run_pipeline(client: Any, build: Callable[[Any], None]) -> list[Any]:
        def no_wait(pipe: Any) -> None:
            pipe.wait = lambda *_: None  # fakeredis has no WAIT: its answer is given here
            build(pipe)

        answers = real(client, no_wait)
        if not given:
            lost()
        given.append(1 if given else 0)
        return [*answers, given[-1]]

    monkeypatch.setattr(base, "run_pipeline", run_pipeline)
    return given


START = {"started_at": 1.0, "worker": "w1", "pid": 1, "task_id": "x", "attempt": 1}
STARTED_EVENT = {"call_id": "c1", "tool": "echo"}


def test_a_start_lost_in_a_failover_yields_to_the_copy_that_claimed_the_new_master(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos soak's case: a delivery's start lands on a master that is demoted before
    a replica copies it, and the broker's second copy of the delivery claims the call on
    the new master before the first start is sent again. The first delivery must not run
    the call as well (its first answer said it could)."""
    store.record_dispatch("t1", {"c1": {"task_id": "x"}})
    theirs = {**START, "worker": "w2", "delivery": "x.1", "claim": "theirs"}

    def lost() -> None:
        store.redis.hset(k.turn_key("t1"), k.STARTED + "c1", json.dumps(theirs))

    given = _failover_on_first_run(store, lost, monkeypatch)
    mine = {**START, "delivery": "x.1", "claim": "mine"}
    assert store.mark_started("t1", "c1", mine, STARTED_EVENT) == Started.REDELIVERED
    assert given == [0, 1]
    assert store.call_progress("t1")[0]["c1"]["claim"] == "theirs"


def test_a_start_a_replica_was_slow_to_acknowledge_still_runs(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, but the first run survived (the replica only acknowledged late): the run
    sent again finds its own claim, and the call runs once."""
    store.record_dispatch("t1", {"c1": {"task_id": "x"}})
    given = _failover_on_first_run(store, lambda: None, monkeypatch)
    mine = {**START, "delivery": "x.1", "claim": "mine"}
    assert store.mark_started("t1", "c1", mine, STARTED_EVENT) == Started.STARTED
    assert given == [0, 1]
    assert store.call_progress("t1")[0]["c1"]["claim"] == "mine"


def test_records_of_a_turn_the_first_scan_did_not_read_whole_are_all_read(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "SCAN_COUNT", 2)
    store.record_dispatch("t1", {f"c{i}": {"task_id": f"x{i}"} for i in range(9)})
    dispatched = store.call_progress("t1")[1]
    assert sorted(dispatched) == [f"c{i}" for i in range(9)]
