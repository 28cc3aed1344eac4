"""A worker's writes while Redis is away: its start record sent again, its result held.

The fault suite (tests/faults/test_faults_redis_outage.py) restarts a real Redis under
load; these pin down the two rules it relies on, with a real Redis and no waiting.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis

from agentq.models import TurnStatus
from agentq.state.calls import Started
from agentq.state.held import HeldWrites
from agentq.tools.calls import HOLD_START_S, start_deadline

pytestmark = pytest.mark.integration


def _turn(store) -> str:  # type: ignore[no-untyped-def]
    tid = uuid.uuid4().hex
    store.create(tid, {"status": "running"}, [{"role": "user", "content": "x"}])
    return tid


def test_a_start_sent_again_with_its_own_claim_runs_the_call(client) -> None:  # type: ignore[no-untyped-def]
    # redis-py sends a START again when Redis closed the connection before answering: the
    # first one was recorded, and the call must run, not be taken for a second delivery.
    store = client._store
    tid = _turn(store)
    start = {"started_at": 1.0, "delivery": "task-1/0", "claim": "aaaa"}
    event = {"call_id": "c1", "tool": "counted"}
    assert store.mark_started(tid, "c1", start, event) is Started.STARTED
    assert store.mark_started(tid, "c1", start, event) is Started.STARTED
    # The broker's second copy of the same delivery has another claim: not run twice.
    other = {**start, "claim": "bbbb"}
    assert store.mark_started(tid, "c1", other, event) is Started.REDELIVERED
    started = [e for e in store.bus.replay(tid, "0-0") if e.type == "tool_started"]
    assert len(started) == 1
    store.close(tid, TurnStatus.FINISHED, "turn_finished", {})


def test_a_held_write_is_written_once_redis_answers() -> None:
    held = HeldWrites()
    failures = [redis.ConnectionError("away"), redis.BusyLoadingError("loading")]
    seen: list[int] = []

    def write() -> str:
        if failures:
            seen.append(held.count)
            raise failures.pop(0)
        return "written"

    assert held.hold(write, time.time() + 30, "a result") == "written"
    # Counted as held from its first failure; nothing held once written.
    assert seen == [0, 1]
    assert held.count == 0
    assert held.wait_none(0)


def test_a_held_write_gives_up_at_its_deadline() -> None:
    held = HeldWrites()

    def write() -> str:
        raise redis.ConnectionError("away for good")

    with pytest.raises(redis.ConnectionError):
        held.hold(write, time.time() + 0.6, "a result")
    assert held.count == 0


def test_no_new_call_is_taken_while_a_write_is_held() -> None:
    held = HeldWrites()
    answer = threading.Event()

    def write() -> None:
        if not answer.is_set():
            raise redis.ConnectionError("away")

    writer = threading.Thread(target=held.hold, args=(write, time.time() + 30, "a result"))
    writer.start()
    try:
        assert not held.wait_none(1.0)  # one failure in: held, so a new call waits
        answer.set()
        assert held.wait_none(5.0)
    finally:
        answer.set()
        writer.join(5)
    assert not writer.is_alive()


def test_a_result_sent_again_changes_nothing(client) -> None:  # type: ignore[no-untyped-def]
    # A held settle whose first write landed (its answer lost) finds its own result
    # stored: first writer wins, one tool_finished.
    from agentq.models import ToolCall
    from agentq.tools.results import error_result

    store = client._store
    tid = _turn(store)
    result = error_result(ToolCall(id="c1", name="counted", arguments=""), "boom")
    assert store.settle(tid, result, wake=False, tracked=False)
    assert not store.settle(tid, result, wake=False, tracked=False)
    finished = [e for e in store.bus.replay(tid, "0-0") if e.type == "tool_finished"]
    assert len(finished) == 1
    store.close(tid, TurnStatus.FINISHED, "turn_finished", {})


def test_a_start_waits_at_most_half_its_hard_limit() -> None:
    # The prefork pool counts the wait in the hard limit: a start held longer would have
    # the call killed before it ran.
    assert start_deadline(30, 100.0) == 115.0
    assert start_deadline(600, 100.0) == 100.0 + HOLD_START_S
    assert start_deadline(0, 100.0) == 100.0 + HOLD_START_S


def test_a_round_result_sent_again_changes_nothing(client) -> None:  # type: ignore[no-untyped-def]
    # A held round result whose first write landed, or the failure a stream worker
    # reports after it, finds the round's result stored: first writer wins.
    from agentq.models import LlmRoundResult

    store = client._store
    tid = _turn(store)
    # Held by this test, so that no step of a fleet this process runs for other tests
    # (woken by each write) takes this bare turn and closes it between the writes.
    assert store.lock_step(tid, "the-test", 120_000)
    answer = LlmRoundResult(ok=True, streamed_s=1.5).model_dump_json()
    events = [("llm_finished", {"round": 0})]
    store.finish_llm_round(tid, 0, answer, events)
    store.finish_llm_round(tid, 0, answer, events)
    failed = LlmRoundResult(ok=False, error="the stream worker failed", error_code="ELLM")
    store.finish_llm_round(tid, 0, failed.model_dump_json())
    state = store.state(tid) or {}
    assert (state.get("llm_result_round"), state.get("llm_result")) == (0, json.loads(answer))
    finished = [e for e in store.bus.replay(tid, "0-0") if e.type == "llm_finished"]
    assert len(finished) == 1
    # The next round is written as before.
    store.finish_llm_round(tid, 1, answer)
    state = store.state(tid) or {}
    assert (state.get("llm_result_round"), state.get("llm_result")) == (1, json.loads(answer))
    store.close(tid, TurnStatus.FINISHED, "turn_finished", {})
