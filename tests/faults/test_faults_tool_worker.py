"""A whole tool worker SIGKILLed mid-call: the turn settles the call by its hard limit plus
grace, and nothing runs it again: the message went with the worker (tool workers consume
without kombu's unacked hash), and a delivery handed out twice is refused by its claim."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentq.local.processes import wait_for
from agentq.models import ToolCall, TurnStatus
from agentq.state.calls import Started
from agentq.testing.openai_server import Round
from agentq.tools.results import error_result
from tests.helpers import assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]

HARD_S, GRACE_S = 2.0, 1.5


def test_dead_tool_worker_call_settles_lost_and_is_not_run_again(rig, tmp_path: Path) -> None:
    count = tmp_path / "count"
    key = rig.script(
        Round(tool_calls=calls(("counted_short", {"path": str(count), "seconds": 30}))),
        Round(text="Went on without it."),
    )
    handle = rig.client._start_turn(key)
    started = rig.collect(handle.turn_id, until=lambda e: e.type == "tool_started")[-1]
    wait_for(lambda: starts(count) == 1, 10, message="the tool to start its work")
    record = rig.client._store.call_progress(handle.turn_id)[0][started.fields["call_id"]]
    task_id, t_start = record["task_id"], float(record["started_at"])
    old = rig.worker("tools")
    old.kill()  # SIGKILL to the whole process group: parent and pool together
    killed_at = time.time()

    events = rig.collect(handle.turn_id, timeout_s=30)
    assert events[-1].type == "turn_finished", events[-1]
    done = next(e for e in events if e.type == "tool_finished")
    assert done.fields["status"] == "lost"
    # Settled by the turn itself: no sooner than hard limit plus grace after the start.
    assert done.ts >= t_start + HARD_S + GRACE_S - 0.05, done.ts - t_start
    assert done.ts - killed_at < HARD_S + GRACE_S + 3.0
    assert_gapless(events)
    assert_valid_history(rig.client.get(handle.turn_id)["history"])

    # The message went with the killed worker: nothing keeps it for a redelivery. A new
    # worker (without mingle it does not learn the turn's revoke from its neighbours)
    # takes the next call from the same queue, and never this one.
    redis = rig.client._store.redis
    assert redis.hlen("unacked") == 0
    new = rig.start("tools", extra_args=("--without-mingle",))[0]
    after = rig.client._start_turn(
        rig.script(Round(tool_calls=calls(("counted", {"path": str(tmp_path / "next")}))))
    )
    assert rig.collect(after.turn_id)[-1].type == "turn_finished"
    assert starts(tmp_path / "next") == 1
    assert task_id not in new.log_text()
    assert starts(count) == 1, "the killed worker's call ran again"
    # No second result, no second tool_finished: the settled result stands.
    log = rig.log_events(handle.turn_id)
    assert [e.fields["status"] for e in log if e.type == "tool_finished"] == ["lost"]
    assert log[-1].type == "turn_finished"


def test_a_delivery_handed_out_again_while_it_runs_does_not_start_twice(rig) -> None:
    # A broker can hand out a call that is still running: RabbitMQ requeues a message
    # whose consumer's connection dropped, and kombu puts back what a worker held when
    # its Redis connection closed.
    store = rig.client._store
    tid = "f" * 32
    store.create(tid, {"status": "running"}, [{"role": "user", "content": "x"}])
    first = {"started_at": 1.0, "delivery": "task-1/0"}
    event = {"call_id": "c1", "tool": "counted"}
    assert store.mark_started(tid, "c1", first, event) is Started.STARTED
    again = store.mark_started(tid, "c1", {**first, "started_at": 2.0}, event)
    assert again is Started.REDELIVERED
    # An explicit retry (Celery's retry count went up) is a new delivery: it may run.
    retried = store.mark_started(tid, "c1", {"started_at": 3.0, "delivery": "task-1/1"}, event)
    assert retried is Started.STARTED
    store.close(tid, TurnStatus.FINISHED, "turn_finished", {})
    # Nothing starts, and nothing settles, in a turn that is over.
    assert store.mark_started(tid, "c2", {"delivery": "task-2/0"}, event) is Started.TURN_GONE
    assert not store.settle(tid, error_result(ToolCall(id="c1", name="counted"), "too late"))
    assert store.results(tid) == {}
    assert [e.type for e in rig.log_events(tid)] == [
        "tool_started",
        "tool_started",
        "turn_finished",
    ]


def test_dead_worker_of_an_unlimited_tool_is_noticed_by_its_heartbeat(rig, tmp_path: Path) -> None:
    """A tool without a hard limit has no deadline: only the worker's heartbeat tells."""
    from agentq.constants import WORKER_ALIVE_TTL_S

    count = tmp_path / "count"
    key = rig.script(
        Round(
            tool_calls=calls(
                ("counted_unlimited", {"path": str(count)}),
                ("counted", {"path": str(tmp_path / "fast")}),
            )
        ),
        Round(text="Went on without it."),
    )
    handle = rig.client._start_turn(key)
    rig.collect(handle.turn_id, until=lambda e: e.type == "tool_finished")
    wait_for(lambda: starts(count) == 1, 10, message="the unlimited tool to start")
    rig.worker("tools").kill()  # parent and pool together: nobody reports the kill
    killed_at = time.time()
    events = rig.collect(handle.turn_id, timeout_s=30)
    assert events[-1].type == "turn_finished", events[-1]
    finished = {e.fields["tool"]: e for e in events if e.type == "tool_finished"}
    lost = finished["counted_unlimited"]
    assert lost.fields["status"] == "lost"
    assert "heartbeat" in lost.fields["error"]
    assert lost.ts - killed_at < WORKER_ALIVE_TTL_S + 4.0, lost.ts - killed_at
    assert finished["counted"].fields["status"] == "ok"
    assert_gapless(events)
    assert_valid_history(rig.client.get(handle.turn_id)["history"])
