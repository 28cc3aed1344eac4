"""The step lock, its fenced writes and the wakeups (state/steplock.py)."""

from __future__ import annotations

import json
import time

from agentq import constants as k
from agentq.config import Settings
from agentq.models import ToolCall, TurnStatus
from agentq.orchestrator.steps import Sweeper
from agentq.state.base import active_turns
from agentq.state.calls import Started
from agentq.state.steplock import Released
from agentq.state.store import TurnStore
from agentq.state.turns import Closed
from agentq.tools.results import error_result
from tests.unit.state.support import CALL, Capture, holder, lock, unsettled


def test_a_turn_without_a_deadline_stays_among_the_open_ones(store: TurnStore) -> None:
    assert active_turns(store.redis) == ["t1"]
    assert store.lock_step("t1", "a", 5000)
    assert store.release_step("t1", "a", None, 5000) == Released.RELEASED
    assert store.redis.zscore(k.WAKEUPS, "t1") == float("inf")
    assert active_turns(store.redis) == ["t1"]
    assert _sweeper(store).look(time.time() + 3600).wakeups == []


def test_one_step_at_a_time_and_a_wake_makes_the_holder_step_again(store: TurnStore) -> None:
    store.flag_cancel("t1", "user")
    view = store.begin_step("t1", "a", 5000)
    assert view is not None and view.state is not None and view.state["status"] == "running"
    assert view.cancel_reason == "user" and view.history == [{"role": "user", "content": "x"}]
    assert store.begin_step("t1", "b", 5000) is None
    store.wake("t1")  # woken while "a" steps
    assert store.release_step("t1", "a", None, 5000) == Released.WOKEN  # keep the lock: step again
    assert store.begin_step("t1", "b", 5000, again=True) is None  # not b's lock
    assert store.begin_step("t1", "a", 5000, again=True) is not None
    assert store.release_step("t1", "a", 123.0, 5000) == Released.RELEASED
    assert store.redis.zscore(k.WAKEUPS, "t1") == 123.0
    assert store.lock_step("t1", "b", 5000) is True


def test_a_step_whose_lock_lapsed_cannot_write(store: TurnStore) -> None:
    assert store.lock_step("t1", "a", 5000) is True
    append = [{"role": "assistant", "content": "x"}]
    kept = store.release_step("t1", "a", None, 0, fields={"round": 1}, append=append, keep=True)
    assert kept is Released.KEPT
    lock(store, "t1", "a", lapsed=True)
    assert store.lock_step("t1", "b", 5000) is True
    lost = store.release_step("t1", "a", None, 0, fields={"round": 9}, keep=True)
    assert lost is Released.LOST
    assert store.release_step("t1", "a", None, 5000) == Released.LOST
    assert store.state("t1")["round"] == 1  # type: ignore[index]
    assert len(store.history("t1")) == 2


def test_a_due_wakeup_is_claimed_by_one_sweeper(store: TurnStore) -> None:
    store.redis.zadd(k.WAKEUPS, {"t1": 100.0})
    assert _sweeper(store).look(99.0).wakeups == []
    assert _sweeper(store).look(100.0).wakeups == ["t1"]
    assert store.claim_wakeup("t1", 100.0, 15) is True
    assert store.claim_wakeup("t1", 100.0, 15) is False  # pushed to 115: its retry
    assert store.redis.zscore(k.WAKEUPS, "t1") == 115.0


def test_a_step_reads_its_rounds_calls_with_its_view(store: TurnStore) -> None:
    c2 = ToolCall(id="c2", name="echo")
    store.redis.hset(k.turn_key("t1"), "round_calls", json.dumps(["c1", "c2"]))
    store.redis.hset(
        k.turn_key("t1"), mapping={k.PLANNED + "c1": "plan-1", k.PLANNED + "c2": "plan-2"}
    )
    store.record_dispatch("t1", {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}})
    assert store.settle("t1", error_result(CALL, "one"), wake=False)
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.round is not None
    assert view.round.ids == ("c1", "c2") and view.round.values[4:] == [b"plan-1", b"plan-2"]
    plans, settled, sent = store.round_view("t1", ["c1", "c2"], read=view.round)
    assert plans == [b"plan-1", b"plan-2"] and list(settled) == ["c1"]
    assert sent == {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}}
    assert store.release_step("t1", "s", None, 5000) == Released.RELEASED
    # The settle that completes the batch takes the step, with the round read in its view.
    capture = Capture()
    store.stepper = capture
    assert store.settle("t1", error_result(c2, "two"))
    (taken,) = capture.views
    assert taken.round is not None and all(taken.round.values[:2])  # both results
    assert holder(store, "t1") is not None
    # A read of other calls is not used: the step reads them itself.
    _, settled, _ = store.round_view("t1", ["c2"], read=taken.round)
    assert settled["c2"].error == "two"


def test_a_lone_calls_settle_hands_its_step_the_view_a_fresh_read_gives(store: TurnStore) -> None:
    store.create("t1", {"status": "running", "round_calls": ["c1"]}, [{"role": "user"}])
    store.redis.hset(k.turn_key("t1"), k.PLANNED + "c1", "plan-1")
    store.record_dispatch("t1", {"c1": {"task_id": "a"}})
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "a", "attempt": 1}
    assert (
        store.mark_started("t1", "c1", start, {"call_id": "c1", "tool": "echo"}) == Started.STARTED
    )
    capture = Capture()
    store.stepper = capture
    # Its settle takes the step with the state it wrote.
    assert store.settle("t1", error_result(CALL, "one"))
    (taken,) = capture.views
    token = holder(store, "t1")
    assert token is not None
    fresh = store.begin_step("t1", token, 5000, again=True)
    assert fresh is not None and taken.state is not None
    assert taken.state == fresh.state
    assert taken.state["seq"] == 2 and taken.state[k.UNSETTLED_FIELD] == 0
    assert taken.history == fresh.history and taken.round == fresh.round
    assert taken.round is not None and taken.round.values[2:] == [b"plan-1"]


def test_a_turn_without_named_round_calls_has_no_round_read(store: TurnStore) -> None:
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.round is None
    store.redis.hset(k.turn_key("t1"), "round_calls", "null")
    assert store.begin_step("t1", "s", 5000, again=True).round is None  # type: ignore[union-attr]


def test_a_step_records_the_calls_it_sends_as_it_lets_go_only_if_it_holds_the_lock(
    store: TurnStore,
) -> None:
    sent = {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}}
    plans = {"c1": "plan-1", "c2": "plan-2"}
    assert store.lock_step("t1", "a", 5000) is True
    assert store.release_step("t1", "b", None, 5000, sent, plans=plans) == Released.LOST
    assert store.call_progress("t1")[1] == {}  # not b's lock: nothing written
    assert store.redis.hget(k.turn_key("t1"), k.PLANNED + "c1") is None
    store.wake("t1")  # woken while "a" steps: the lock is kept, the records written
    assert store.release_step("t1", "a", None, 5000, sent, plans=plans) == Released.WOKEN
    assert store.call_progress("t1")[1] == sent
    assert store.redis.hget(k.turn_key("t1"), k.PLANNED + "c2") == b"plan-2"
    assert unsettled(store, "t1") == 2
    # Sent again (the pickup), a call is not counted twice.
    assert store.begin_step("t1", "a", 5000, again=True) is not None  # the step reads again
    again = {"c2": {"task_id": "b", "sends": 2}}
    assert store.release_step("t1", "a", None, 5000, again) == Released.RELEASED
    assert unsettled(store, "t1") == 2
    # The broker went away before c2 went out again, and c1 was never sent at all: c1
    # leaves the batch in flight, c2 gets its earlier count of sends back.
    store.unrecord("t1", {"c1": sent["c1"], "c2": again["c2"]})
    assert store.call_progress("t1")[1] == {"c2": {"task_id": "b", "sends": 1}}
    assert unsettled(store, "t1") == 1
    # Ending the turn lets go of the lock in the same write.
    assert store.lock_step("t1", "a", 5000) is True
    assert store.close("t1", TurnStatus.FINISHED, "turn_finished", {}, token="a") == Closed.ENDED
    assert holder(store, "t1") is None


def _sweeper(store: TurnStore) -> Sweeper:
    return Sweeper(store, None, Settings())  # type: ignore[arg-type]
