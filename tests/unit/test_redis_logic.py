"""The Lua state machines of the store, on fakeredis: first writer wins, answers close once,
one step at a time, nothing after the end."""

from __future__ import annotations

import json
import time
from typing import Any

import fakeredis
import pytest

from agentq import constants as k
from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.events.bus import event_body
from agentq.models import InteractionAnswer, InteractionRequest, ToolCall, TurnStatus
from agentq.state.base import StepView
from agentq.state.interactions import Interactions
from agentq.state.store import TurnStore
from agentq.tools.results import cancelled_result, error_result


@pytest.fixture()
def store() -> TurnStore:
    s = TurnStore(fakeredis.FakeRedis())
    s.create("t1", {"status": "running"}, [{"role": "user", "content": "x"}])
    return s


CALL = ToolCall(id="c1", name="echo")


def _dirty(store: TurnStore, turn_id: str) -> bool:
    return store.redis.hget(k.turn_key(turn_id), k.DIRTY_FIELD) == b"1"


def _unsettled(store: TurnStore, turn_id: str) -> int:
    return int(store.redis.hget(k.turn_key(turn_id), k.UNSETTLED_FIELD) or 0)


def _lock(store: TurnStore, turn_id: str, token: str, *, lapsed: bool = False) -> None:
    """Set the step lock as a step elsewhere left it: held by `token`, or lapsed."""
    until = 1 if lapsed else int(time.time() * 1000) + 10_000
    store.redis.hset(k.turn_key(turn_id), k.STEP_FIELD, json.dumps(f"{token}:{until}"))


def test_first_settle_wins_publishes_once_and_wakes_the_turn(store: TurnStore) -> None:
    woken: list[str] = []
    store.waker = woken.append
    assert store.settle("t1", error_result(CALL, "first")) is True
    assert store.settle("t1", cancelled_result(CALL)) is False
    assert store.results("t1")["c1"].error == "first"
    finished = [e for e in store.bus.replay("t1") if e.type == "tool_finished"]
    assert len(finished) == 1 and finished[0].fields["status"] == "error"
    assert woken == ["t1"]  # the losing settle wakes nobody
    assert _dirty(store, "t1")
    # The backstop: a sweeper steps the turn soon even if the step message was lost.
    assert store.redis.zscore(k.WAKEUPS, "t1") is not None


def test_nothing_after_the_turn_is_over(store: TurnStore) -> None:
    assert store.close("t1", TurnStatus.ABORTED, "turn_aborted", {"reason": "user"}) == 1
    assert store.close("t1", TurnStatus.ERROR, "turn_error", {"code": "x"}) == 0
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
    assert store.release_step("t1", "late", None, 5000) == 1
    assert store.redis.zscore(k.WAKEUPS, "t1") is None
    assert store.active() == []


def test_a_turn_without_a_deadline_stays_among_the_open_ones(store: TurnStore) -> None:
    assert store.active() == ["t1"]
    assert store.lock_step("t1", "a", 5000)
    assert store.release_step("t1", "a", None, 5000) == 1
    assert store.redis.zscore(k.WAKEUPS, "t1") == float("inf")
    assert store.active() == ["t1"] and store.due_wakeups(time.time() + 3600) == []


def test_one_step_at_a_time_and_a_wake_makes_the_holder_step_again(store: TurnStore) -> None:
    store.flag_cancel("t1", "user")
    view = store.begin_step("t1", "a", 5000)
    assert view is not None and view.state is not None and view.state["status"] == "running"
    assert view.cancel_reason == "user" and view.history == [{"role": "user", "content": "x"}]
    assert store.begin_step("t1", "b", 5000) is None
    store.wake_here("t1")  # woken while "a" steps
    assert store.release_step("t1", "a", None, 5000) == 0  # keep the lock: step again
    assert store.begin_step("t1", "b", 5000, again=True) is None  # not b's lock
    assert store.begin_step("t1", "a", 5000, again=True) is not None
    assert store.release_step("t1", "a", 123.0, 5000) == 1
    assert store.redis.zscore(k.WAKEUPS, "t1") == 123.0
    assert store.lock_step("t1", "b", 5000) is True


def test_a_step_whose_lock_lapsed_cannot_write(store: TurnStore) -> None:
    assert store.lock_step("t1", "a", 5000) is True
    assert store.commit("t1", "a", {"round": 1}, [{"role": "assistant", "content": "x"}])
    _lock(store, "t1", "a", lapsed=True)
    assert store.lock_step("t1", "b", 5000) is True
    assert store.commit("t1", "a", {"round": 9}) is False
    assert store.release_step("t1", "a", None, 5000) == -1
    assert store.state("t1")["round"] == 1  # type: ignore[index]
    assert len(store.history("t1")) == 2


def test_a_due_wakeup_is_claimed_by_one_sweeper(store: TurnStore) -> None:
    store.redis.zadd(k.WAKEUPS, {"t1": 100.0})
    assert store.due_wakeups(99.0) == []
    assert store.due_wakeups(100.0) == ["t1"]
    assert store.claim_wakeup("t1", 100.0, 15) is True
    assert store.claim_wakeup("t1", 100.0, 15) is False  # pushed to 115: its retry
    assert store.redis.zscore(k.WAKEUPS, "t1") == 115.0


def test_start_refused_when_settled_or_cancelled(store: TurnStore) -> None:
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "x", "attempt": 1}
    event = {"call_id": "c2", "tool": "echo"}
    # Started beside another call in flight (3 would say it is the batch's only one).
    store.record_dispatch("t1", {"c2": {"task_id": "x"}, "c5": {"task_id": "y"}})
    assert store.mark_started("t1", "c2", start, event) == 1
    store.settle("t1", error_result(ToolCall(id="c3", name="echo"), "done"))
    assert store.mark_started("t1", "c3", start, event) == 0
    store.flag_cancel("t1", "user")
    assert store.mark_started("t1", "c4", start, event) == -1


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


def test_seq_increases_by_one_per_event(store: TurnStore) -> None:
    for i in range(5):
        store.bus.publish("t1", "llm_delta", text=str(i))
    assert [e.seq for e in store.bus.replay("t1")] == [1, 2, 3, 4, 5]


def test_an_interaction_closes_exactly_once(store: TurnStore) -> None:
    inter = Interactions(store)
    req = InteractionRequest(request_id="r1", kind="password", prompt="?", timeout_ms=1000)
    inter.open("t1", req)
    inter.answer("t1", "r1", InteractionAnswer(decision="approve", value="s3cret"))
    with pytest.raises(InteractionClosed) as info:
        inter.answer("t1", "r1", InteractionAnswer(decision="deny"))
    assert info.value.state == "answered"
    assert inter.expire("t1", "r1") is False  # the answer won the race
    answered = [e for e in store.bus.replay("t1") if e.type == "interaction_answered"]
    assert len(answered) == 1 and "s3cret" not in answered[0].model_dump_json()
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


def test_the_sweeper_drops_index_entries_of_expired_turns_and_keeps_live_ones() -> None:
    from agentq.config import Settings
    from agentq.orchestrator.steps import PRUNE_BATCH, Sweeper

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    now = 1_000_000.0
    retention_s = 3600
    old = now - retention_s - 10
    # More expired entries than one batch, with live old turns among them.
    expired = [f"gone{i}" for i in range(PRUNE_BATCH + 120)]
    live = [f"live{i}" for i in range(PRUNE_BATCH + 5)]
    r.zadd(k.TURNS_INDEX, {t: old - i for i, t in enumerate(live)})
    r.zadd(k.TURNS_INDEX, {t: old + i * 0.001 for i, t in enumerate(expired)})
    r.zadd(k.TURNS_INDEX, {"recent": now - 5})
    for t in live:
        r.hset(k.turn_key(t), "status", "running")
    sweeper = Sweeper(store, None, Settings(turn_retention_s=retention_s))  # type: ignore[arg-type]
    assert sweeper.prune_index(now) == len(expired)
    left = {m.decode() for m in r.zrange(k.TURNS_INDEX, 0, -1)}
    assert left == {*live, "recent"}


def test_a_step_ends_the_turn_with_its_last_messages_only_while_it_holds_the_lock(
    store: TurnStore,
) -> None:
    store.create("t2", {"status": "running"}, [{"role": "user", "content": "hi"}])
    assert store.begin_step("t2", "mine", 10_000) is not None
    last = [{"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    # A step whose lock lapsed and was taken by another writes nothing, not even the end.
    _lock(store, "t2", "theirs")
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last) == -1
    )
    assert store.history("t2") == [{"role": "user", "content": "hi"}]
    assert store.status("t2") == "running" and not store.bus.replay("t2")
    _lock(store, "t2", "mine")
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last) == 1
    )
    assert store.history("t2") == [{"role": "user", "content": "hi"}, *last]
    assert store.status("t2") == "finished"
    assert [e.type for e in store.bus.replay("t2")] == ["turn_finished"]
    # Ended: a second end (a retry after a failover) appends nothing twice.
    assert (
        store.close("t2", TurnStatus.FINISHED, "turn_finished", {}, token="mine", append=last) == 0
    )
    assert len(store.history("t2")) == 2


class _Capture:
    """An inline stepper that keeps the views it is handed."""

    def __init__(self) -> None:
        self.views: list[StepView] = []

    def lock_ms(self) -> int | None:
        return 5000

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        self.views.append(view)


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
    assert view.round.ids == ("c1", "c2") and view.round.plans == [b"plan-1", b"plan-2"]
    plans, settled, sent = store.round_plans_view("t1", ["c1", "c2"], read=view.round)
    assert plans == [b"plan-1", b"plan-2"] and list(settled) == ["c1"]
    assert sent == {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}}
    assert store.release_step("t1", "s", None, 5000) == 1
    # The settle that completes the batch takes the step, with the round read in its view.
    capture = _Capture()
    store.stepper = capture
    assert store.settle("t1", error_result(c2, "two"))
    (taken,) = capture.views
    assert taken.round is not None and all(taken.round.results)
    assert store.step_holder("t1") is not None
    # A read of other calls is not used: the step reads them itself.
    _, settled, _ = store.round_plans_view("t1", ["c2"], read=taken.round)
    assert settled["c2"].error == "two"


def test_a_lone_calls_settle_hands_its_step_the_view_a_fresh_read_gives(store: TurnStore) -> None:
    store.create("t1", {"status": "running", "round_calls": ["c1"]}, [{"role": "user"}])
    store.redis.hset(k.turn_key("t1"), k.PLANNED + "c1", "plan-1")
    store.record_dispatch("t1", {"c1": {"task_id": "a"}})
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "a", "attempt": 1}
    assert store.mark_started("t1", "c1", start, {"call_id": "c1", "tool": "echo"}) == 3
    capture = _Capture()
    store.stepper = capture
    # Its settle reads the state whole before it writes, and lays its writes over it.
    assert store.settle("t1", error_result(CALL, "one"), alone=True)
    (taken,) = capture.views
    token = store.step_holder("t1")
    assert token is not None
    fresh = store.begin_step("t1", token, 5000, again=True)
    assert fresh is not None and taken.state is not None
    assert taken.state == fresh.state
    assert taken.state["seq"] == 2 and taken.state[k.UNSETTLED_FIELD] == 0
    assert taken.history == fresh.history and taken.round == fresh.round
    assert taken.round is not None and taken.round.plans == [b"plan-1"]


def test_a_turn_without_named_round_calls_has_no_round_read(store: TurnStore) -> None:
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.round is None
    store.redis.hset(k.turn_key("t1"), "round_calls", "null")
    assert store.begin_step("t1", "s", 5000, again=True).round is None  # type: ignore[union-attr]


def test_only_the_settle_that_completes_the_batch_in_flight_wakes_the_turn(
    store: TurnStore,
) -> None:
    c2 = ToolCall(id="c2", name="echo")
    store.record_dispatch("t1", {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}})
    assert _unsettled(store, "t1") == 2
    assert store.settle("t1", error_result(CALL, "first"))
    assert not _dirty(store, "t1") and _unsettled(store, "t1") == 1
    assert store.settle("t1", error_result(c2, "last"))
    assert _dirty(store, "t1") and _unsettled(store, "t1") == 0


def test_a_step_records_the_calls_it_sends_as_it_lets_go_only_if_it_holds_the_lock(
    store: TurnStore,
) -> None:
    sent = {"c1": {"task_id": "a"}, "c2": {"task_id": "b"}}
    plans = {"c1": "plan-1", "c2": "plan-2"}
    assert store.lock_step("t1", "a", 5000) is True
    assert store.release_step("t1", "b", None, 5000, sent, plans=plans, new_calls=2) == -1
    assert store.dispatches("t1") == {}  # not b's lock: nothing written
    assert store.redis.hget(k.turn_key("t1"), k.PLANNED + "c1") is None
    store.wake_here("t1")  # woken while "a" steps: the lock is kept, the records written
    assert store.release_step("t1", "a", None, 5000, sent, plans=plans, new_calls=2) == 0
    assert store.dispatches("t1") == sent
    assert store.redis.hget(k.turn_key("t1"), k.PLANNED + "c2") == b"plan-2"
    assert _unsettled(store, "t1") == 2
    # Sent again (the pickup), a call is not counted twice.
    assert store.begin_step("t1", "a", 5000, again=True) is not None  # the step reads again
    again = {"c2": {"task_id": "b", "sends": 2}}
    assert store.release_step("t1", "a", None, 5000, again, new_calls=0) == 1
    assert _unsettled(store, "t1") == 2
    # The broker went away before c2 went out again, and c1 was never sent at all: c1
    # leaves the batch in flight, c2 gets its earlier count of sends back.
    store.unrecord("t1", {"c1": sent["c1"], "c2": again["c2"]})
    assert store.dispatches("t1") == {"c2": {"task_id": "b", "sends": 1}}
    assert _unsettled(store, "t1") == 1
    # Ending the turn lets go of the lock in the same write.
    assert store.lock_step("t1", "a", 5000) is True
    assert store.close("t1", TurnStatus.FINISHED, "turn_finished", {}, token="a") == 1
    assert store.step_holder("t1") is None


def publish_many(store: TurnStore, batches: dict[str, list[tuple[str, dict[str, Any]]]]) -> None:
    """As a stream worker publishes: event bodies of several turns in one go."""
    store.bus.publish_many(
        {t: [event_body(t, type_, f) for type_, f in events] for t, events in batches.items()}
    )


def test_publish_many_keeps_each_turns_order_and_skips_ended_turns(store: TurnStore) -> None:
    from agentq.events import bus as bus_module

    store.create("t2", {"status": "running"}, [{"role": "user", "content": "y"}])
    store.create("t3", {"status": "running"}, [{"role": "user", "content": "z"}])
    store.bus.publish("t1", "llm_started")
    assert store.close("t3", TurnStatus.ABORTED, "turn_aborted", {"reason": "user"}) == 1
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


def test_the_writes_that_publish_counted_events_count_them_once(
    store: TurnStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentq.state import base
    from agentq.telemetry.fleetcounts import FleetCounts, field_of

    counts = FleetCounts()
    monkeypatch.setattr(base, "fleet_counts", counts)
    store.metrics_flush_s = 3600  # the flusher that starts waits: nothing leaves here
    try:
        store.bus.publish("t1", "llm_queued", model="m", position=1, first=True)
        store.bus.publish("t1", "llm_started", model="m", queued_ms=5)
        store.bus.publish("t1", "llm_started", model="m", round_no=1)  # did not wait
        finished = {"code": "ETIMEDOUT", "error": "idle"}
        publish_many(store, {"t1": [("llm_delta", {"text": "a"}), ("llm_finished", finished)]})
        store.bus.publish("t1", "tool_progress", message="half")
        assert store.settle("t1", error_result(CALL, "boom")) is True
        assert store.settle("t1", error_result(CALL, "again")) is False  # not published
        assert store.close("t1", TurnStatus.FINISHED, "turn_finished", {}) == 1
        # Refused after the end: nothing published, nothing counted.
        assert store.bus.publish("t1", "turn_error", code="x") == 0
        publish_many(store, {"t1": [("llm_retry", {"code": "ETIMEDOUT"})]})
        got = counts.pending()
    finally:
        counts.stop()
    assert got.pop(field_of("llm_rounds_queued", ("m",))) == 1
    assert got.pop(field_of("llm_queue_wait_seconds", ("m",), "0")) == 1  # under 0.1 s
    assert got.pop(field_of("llm_queue_wait_seconds", ("m",), "sum")) == pytest.approx(0.005)
    assert got.pop(field_of("watchdog_trips", ())) == 1
    assert got.pop(field_of("tool_results", ("echo", "error"))) == 1
    assert got.pop(field_of("turns_ended", ("finished",))) == 1
    assert got == {}


def test_a_turns_call_records_are_fields_of_its_state_that_state_reads_leave_out(
    store: TurnStore,
) -> None:
    store.record_dispatch("t1", {"c1": {"task_id": "a"}})
    start = {"started_at": 1.0, "worker": "w", "pid": 1, "task_id": "a", "attempt": 1}
    assert store.mark_started("t1", "c1", start, {"call_id": "c1", "tool": "echo"}) == 3
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
    assert store.results("t1")["c1"].error == "one" and store.starts("t1")["c1"]["pid"] == 1


def test_an_older_layouts_call_records_move_into_each_turns_state_once() -> None:
    from agentq.state.layout import LAYOUT, LAYOUT_KEY, upgrade_layout

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    store.create("t2", {"status": "running"}, [])
    old = k.turn_key("t2") + ":calls"
    r.hset(old, mapping={k.DISPATCHED + "c1": '{"task_id": "a"}', k.SETTLED + "c1": "old"})
    # A newer worker settled the call meanwhile: its result stays.
    r.hset(k.turn_key("t2"), k.SETTLED + "c1", "new")
    # The records of a turn whose state is gone are dropped, not made into half a turn.
    r.hset(k.turn_key("gone") + ":calls", k.SETTLED + "c9", "x")
    assert upgrade_layout(r) == 2
    assert not r.exists(old) and not r.exists(k.turn_key("gone") + ":calls")
    assert not r.exists(k.turn_key("gone"))
    assert r.hget(k.turn_key("t2"), k.SETTLED + "c1") == b"new"
    assert store.dispatches("t2") == {"c1": {"task_id": "a"}}
    assert int(r.get(LAYOUT_KEY) or 0) == LAYOUT
    # Once per Redis: a later start of a worker does not look again.
    r.hset(old, k.SETTLED + "c2", "late")
    assert upgrade_layout(r) == 0 and r.exists(old)


def test_an_older_layouts_history_lists_move_into_each_turns_state_once() -> None:
    from agentq.state.layout import upgrade_layout

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(12)]
    store.create("t1", {"status": "running"}, [])
    r.rpush(k.turn_key("t1") + ":history", *[json.dumps(m) for m in messages])
    # A turn with a history of its own (a newer worker's) keeps it.
    store.create("t2", {"status": "running"}, [{"role": "user", "content": "new"}])
    r.rpush(k.turn_key("t2") + ":history", json.dumps({"role": "user", "content": "old"}))
    r.rpush(k.turn_key("gone") + ":history", json.dumps(messages[0]))
    assert upgrade_layout(r) == 3
    assert store.history("t1") == messages  # in order, past index 9
    assert store.history("t2") == [{"role": "user", "content": "new"}]
    assert not r.keys("*:history") and not r.exists(k.turn_key("gone"))
    # The next step appends after them.
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.history == messages
    assert store.release_step("t1", "s", None, 5000, append=[{"role": "assistant", "content": "a"}])
    assert store.history("t1") == [*messages, {"role": "assistant", "content": "a"}]
    state = store.state("t1")
    assert state is not None and state[k.HISTORY_LEN_FIELD] == 13
    assert not [f for f in state if f.startswith(k.MESSAGE)]
