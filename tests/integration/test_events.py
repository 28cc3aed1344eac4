"""The event bus against a real Redis: late subscribers and reconnects miss nothing."""

from __future__ import annotations

import threading
import uuid

import pytest

from agentq.runtime import get_store
from agentq.testing.processes import wait_for

pytestmark = pytest.mark.integration


def test_late_subscriber_gets_every_event_exactly_once(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
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
        for ev in bus.follow(turn_id):
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
    for i in range(20):
        bus.publish(turn_id, "llm_delta", text=str(i))
    bus.publish(turn_id, "turn_finished", reason="stop")
    first = [e for e in bus.follow(turn_id) if e is not None]
    assert [e.seq for e in first] == list(range(1, 22))
    assert all(e.stream_id for e in first)
    rest = [e for e in bus.follow(turn_id, after_id=first[9].stream_id or "") if e is not None]
    assert [e.seq for e in rest] == list(range(11, 22))


def test_live_copy_carries_the_stream_id_for_sse(agentq_env) -> None:
    bus = get_store().bus
    turn_id = uuid.uuid4().hex
    got = []
    done = threading.Event()

    def follow() -> None:
        for ev in bus.follow(turn_id):
            if ev is not None:
                got.append(ev)
        done.set()

    t = threading.Thread(target=follow)
    t.start()
    wait_for(lambda: bus.redis.pubsub_numsub(f"agentq:turn:{turn_id}:events")[0][1] > 0, 5)
    bus.publish(turn_id, "turn_started")
    bus.publish(turn_id, "turn_finished", reason="stop")
    assert done.wait(5)
    t.join(5)
    log_ids = [e.stream_id for e in bus.replay(turn_id)]
    assert [e.stream_id for e in got] == log_ids
    assert [e.type for e in got] == ["turn_started", "turn_finished"]
