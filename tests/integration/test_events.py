"""The event bus against a real Redis: late subscribers and reconnects miss nothing."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from agentq import constants as k
from agentq.events.follow import follow
from agentq.fleet.runtime import get_store
from agentq.local.processes import wait_for

pytestmark = pytest.mark.integration


def test_late_subscriber_gets_every_event_exactly_once(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    bus.redis.hset(k.turn_key(turn_id), "status", json.dumps("running"))
    total = 600
    joined = threading.Event()

    def publisher() -> None:
        for i in range(total):
            if i == total // 3:
                joined.wait(5)  # let the subscriber join while events keep coming
            bus.publish(turn_id, "tool_progress", i=i)
        bus.publish(turn_id, "turn_finished", reason="stop")

    t = threading.Thread(target=publisher)
    t.start()
    try:
        wait_for(lambda: len(bus.replay(turn_id)) >= total // 3, 10, message="first third")
        seqs = []
        for ev in follow(bus, turn_id):
            if ev is None:
                continue
            if not joined.is_set():
                joined.set()
            seqs.append(ev.seq)
        assert seqs == list(range(1, total + 2))
    finally:
        joined.set()
        t.join(10)


def test_resume_after_a_stream_id_gives_exactly_the_rest(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    bus.redis.hset(k.turn_key(turn_id), "status", json.dumps("running"))
    for i in range(20):
        bus.publish(turn_id, "llm_delta", text=str(i))
    bus.publish(turn_id, "turn_finished", reason="stop")
    first = [e for e in follow(bus, turn_id) if e is not None]
    assert [e.seq for e in first] == list(range(1, 22))
    assert all(e.stream_id for e in first)
    rest = [e for e in follow(bus, turn_id, after=first[9].stream_id or "") if e is not None]
    assert [e.seq for e in rest] == list(range(11, 22))


def _live_copies(bus: Any, turn_id: str, publish: Callable[[], None]) -> int:
    """How many messages the turn's channel carried while `publish` ran, seen by a plain
    subscriber (which does not count itself as a follower). Redis writes a PUBLISH's
    messages before its reply, so a PING answered after them closes the count."""
    listener = bus.redis.pubsub()
    listener.subscribe(k.turn_key(turn_id, "events"))
    try:
        assert listener.get_message(timeout=5)["type"] == "subscribe"
        publish()
        listener.ping()
        copies = 0
        while True:
            msg = listener.get_message(timeout=5)
            assert msg is not None, "no PONG"
            if msg["type"] == "pong":
                return copies
            copies += msg["type"] == "message"
    finally:
        listener.close()


def test_live_copy_carries_the_stream_id_for_sse(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    bus.redis.hset(k.turn_key(turn_id), "status", json.dumps("running"))
    got = []
    done = threading.Event()

    def run() -> None:
        for ev in follow(bus, turn_id):
            if ev is not None:
                got.append(ev)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: bus.redis.hget(k.turn_key(turn_id), "watchers") == b"1", 5)

    def two() -> None:
        bus.publish(turn_id, "turn_started")
        bus.publish(turn_id, "llm_delta", text="x")

    # Followed: each event's live copy goes to the turn's channel.
    assert _live_copies(bus, turn_id, two) == 2
    bus.publish(turn_id, "turn_finished", reason="stop")
    assert done.wait(5)
    t.join(5)
    log_ids = [e.stream_id for e in bus.replay(turn_id)]
    assert [e.stream_id for e in got] == log_ids
    assert [e.type for e in got] == ["turn_started", "llm_delta", "turn_finished"]
    # The follower counted itself out as it stopped.
    assert int(bus.redis.hget(k.turn_key(turn_id), "watchers") or 0) == 0


def test_an_unfollowed_turns_events_go_to_its_log_only(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    bus.redis.hset(k.turn_key(turn_id), "status", json.dumps("running"))

    def five() -> None:
        for i in range(5):
            bus.publish(turn_id, "llm_delta", text=str(i))

    assert _live_copies(bus, turn_id, five) == 0
    assert [e.seq for e in bus.replay(turn_id)] == [1, 2, 3, 4, 5]


def test_progress_events_while_a_tool_runs_and_in_flower(fleet, llm_server, client) -> None:
    from celery.result import AsyncResult

    from agentq.fleet.runtime import get_app
    from agentq.testing.openai_server import Round
    from tests.helpers import calls, script

    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 3}))), Round(text="ok"))
    h = client._start_turn(key)
    seen_progress_state = []
    events = []
    for ev in client.events(h.turn_id, heartbeat_s=0.2):
        if ev is not None:
            events.append(ev)
            if ev.type in ("turn_finished", "turn_error", "turn_aborted"):
                break
        started = [e for e in events if e.type == "tool_started"]
        if started and not seen_progress_state:
            task_id = f"{h.turn_id}.{started[0].fields['call_id']}.1"
            res = AsyncResult(task_id, app=get_app())
            if res.state == "PROGRESS":
                seen_progress_state.append(res.info)
    assert events[-1].type == "turn_finished"
    by_worker = [e for e in events if e.type == "tool_progress" and e.fields["source"] == "worker"]
    by_tool = [e for e in events if e.type == "tool_progress" and e.fields["source"] == "tool"]
    # The worker running the call ticks every second in the test settings (5 s by default).
    assert len(by_worker) >= 2
    elapsed = [e.fields["elapsed_ms"] for e in by_worker]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 1000
    assert by_tool and by_tool[0].fields["message"] == "sleeping"
    # Flower reads task states: the tool's progress is visible there as PROGRESS.
    assert seen_progress_state and seen_progress_state[0]["tool"] == "sleep"


def test_a_follower_whose_mark_was_lost_marks_the_turn_again(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    bus.redis.hset(k.turn_key(turn_id), "status", json.dumps("running"))
    got: list[int] = []

    def run() -> None:
        for ev in follow(bus, turn_id, heartbeat_s=0.2):
            if ev is not None:
                got.append(ev.seq)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def marks() -> int:
        return int(bus.redis.hget(k.turn_key(turn_id), "watchers") or 0)

    wait_for(lambda: marks() == 1, 5, message="the follower's mark")
    bus.publish(turn_id, "llm_delta", text="first")
    wait_for(lambda: got == [1], 10, message="the first event")  # past its first log read
    # As a failover that did not carry the mark over would leave it.
    bus.redis.hdel(k.turn_key(turn_id), "watchers")
    bus.publish(turn_id, "llm_delta", text="missed live")
    # The follower, checking its mark now and then, marks the turn again: the next
    # events go out live.
    wait_for(lambda: got == [1, 2], 10, message="the event, from the log")
    wait_for(lambda: marks() == 1, 10, message="the mark, again")
    assert _live_copies(bus, turn_id, lambda: bus.publish(turn_id, "llm_delta", text="x")) == 1
    bus.publish(turn_id, "turn_finished", reason="stop")
    t.join(10)
    assert got == [1, 2, 3, 4]
    # Counted out by as many as it counted in, and never below none.
    assert bus.redis.hget(k.turn_key(turn_id), "watchers") is None
