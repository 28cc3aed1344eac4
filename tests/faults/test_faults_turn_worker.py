"""Turn workers die between and during steps: a waiting turn holds nothing, so nothing is lost.

A turn is a state machine in Redis; its steps are short tasks. Killing every turn worker
while the turn waits leaves its wake messages and deadlines in the broker and Redis for
the next worker; a step that died holding the turn's lock is taken over when the lock
lapses; a step delivered many times acts once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentq import constants as k
from agentq.fleet.broker import send_step
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import assert_gapless, assert_valid_history, busy_factor, calls, starts
from tests.unit.state.support import holder

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(120)]

STEP_LOCK_S = 1.5  # the rig's AGENTQ_STEP_LOCK_S


def _three_rounds(rig, tmp_path: Path) -> tuple[str, Path, Path, Path]:  # type: ignore[no-untyped-def]
    fast, slow, later = (tmp_path / n for n in ("fast", "slow", "later"))
    key = rig.script(
        Round(
            tool_calls=calls(
                ("counted", {"path": str(fast)}), ("counted", {"path": str(slow), "seconds": 3})
            )
        ),
        Round(text="One more.", tool_calls=calls(("counted", {"path": str(later)}))),
        Round(text="All done."),
    )
    return key, fast, slow, later


def _check_done(rig, tid: str, counted: tuple[Path, ...]) -> None:  # type: ignore[no-untyped-def]
    events = rig.collect(tid, timeout_s=60)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == "All done."
    # No finished call ran again, and no call in flight was sent twice.
    assert [starts(p) for p in counted] == [1] * len(counted)
    statuses = [e.fields["status"] for e in events if e.type == "tool_finished"]
    assert statuses == ["ok"] * len(counted)
    log = rig.log_events(tid)
    assert_gapless(log)
    assert [e.seq for e in log] == [e.seq for e in events]
    turn = rig.client.get(tid)
    assert_valid_history(turn["history"])
    assert [m["role"] for m in turn["history"]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert turn["state"]["status"] == "finished"
    # The step that ended the turn lets go of it just after the terminal event.
    wait_for(
        lambda: holder(rig.client._store, tid) is None,
        10,
        message="the last step released the turn",
    )


def test_every_turn_worker_killed_while_the_turn_waits_loses_nothing(rig, tmp_path: Path) -> None:
    key, fast, slow, later = _three_rounds(rig, tmp_path)
    tid = rig.client._start_turn(key).turn_id
    rig.collect(
        tid, until=lambda e: e.type == "tool_started" and e.fields["call_id"] == "call_r0_1"
    )
    wait_for(lambda: starts(fast) == 1 and starts(slow) == 1, 10)
    rig.worker("turns").kill()
    try:
        # With no turn worker alive the turn still goes on: the workers that settle its
        # calls and finish its model rounds take its next steps themselves.
        _check_done(rig, tid, (fast, slow, later))
    finally:
        rig.start("turns")  # the module's other tests need one


def test_a_step_that_died_holding_the_turn_is_taken_over(rig, tmp_path: Path) -> None:
    key, fast, slow, later = _three_rounds(rig, tmp_path)
    tid = rig.client._start_turn(key).turn_id
    rig.collect(
        tid, until=lambda e: e.type == "tool_started" and e.fields["call_id"] == "call_r0_1"
    )
    wait_for(lambda: starts(slow) == 1, 10)
    # A step of a worker that died mid-way: its lock stays until it lapses.
    store = rig.client._store
    wait_for(lambda: store.lock_step(tid, "dead-step", int(STEP_LOCK_S * 1000)), 10)
    held_at = time.time()
    assert len(store.results(tid)) < 2, "the slow call settled before the lock was taken"
    events = rig.collect(
        tid, timeout_s=40, until=lambda e: e.type == "llm_started" and e.fields.get("round_no") == 1
    )
    # The next round started only once the dead step's lock lapsed.
    assert events[-1].ts >= held_at + STEP_LOCK_S - 0.2, events[-1].ts - held_at
    _check_done(rig, tid, (fast, slow, later))


def test_calls_recorded_but_never_sent_are_sent_after_the_pickup_and_run_once(
    make_rig, tmp_path: Path
) -> None:
    """A step records a batch's calls as it lets go of the turn, then sends them: one that
    died in between leaves calls recorded that nobody sent. The step that wakes
    PICKUP_LEASES later sends each call that has not started, and cannot be waiting in its
    queue, again, once, under its task id, and the calls run once each."""
    rig = make_rig(AGENTQ_TURN_LEASE_S="1")  # the pickup after 4 s
    rig.start("llm", "turns")  # no tool worker: the calls' messages wait in the broker
    key, fast, slow, later = _three_rounds(rig, tmp_path)
    tid = rig.client._start_turn(key).turn_id
    store = rig.client._store
    queued = [k.QUEUE_TOOLS, *[f"{k.QUEUE_TOOLS}\x06\x16{p}" for p in (3, 6, 9)]]
    wait_for(
        lambda: sum(store.redis.llen(q) for q in queued) == 2,
        20,
        message="the step recorded and sent the first batch",
    )
    first = store.call_progress(tid)[1]
    assert set(first) == {"call_r0_0", "call_r0_1"}
    # While the calls' queue holds messages they may be among them (a backlog): the
    # pickup's step looks and sends nothing again, and looks again a pickup later (it
    # once returned the queue's allowance instead, 300 s, and the turn waited that long).
    wait_for(
        lambda: rig.worker("turns").log_text().count("not sent again while it does") >= 2,
        30,
        message="the pickup's step held the calls back, twice",
    )
    assert all(d.get("sends", 1) == 1 for d in store.call_progress(tid)[1].values())
    assert sum(store.redis.llen(q) for q in queued) == 2
    # As if the step had died between its write and its sends: the messages never left.
    store.redis.delete(*queued)
    rig.start("tools")
    wait_for(
        lambda: all(d.get("sends") == 2 for d in store.call_progress(tid)[1].values()),
        30,
        message="the pickup sent both calls again",
    )
    again = store.call_progress(tid)[1]
    for cid, rec in first.items():
        # The same task id, and the queue allowance still runs from the first send.
        assert again[cid]["task_id"] == rec["task_id"]
        assert again[cid]["dispatched_at"] == rec["dispatched_at"]
    _check_done(rig, tid, (fast, slow, later))


def test_a_step_delivered_many_times_acts_once(rig, tmp_path: Path) -> None:
    key, fast, slow, later = _three_rounds(rig, tmp_path)
    tid = rig.client._start_turn(key).turn_id
    app = rig.client.app
    # Duplicates of every step message, before, while and after the calls run.
    for _ in range(3):
        for _ in range(20):
            send_step(app, tid)
        time.sleep(0.5)
    _check_done(rig, tid, (fast, slow, later))


def test_an_approval_deadline_fires_after_its_turn_worker_died(rig, tmp_path: Path) -> None:
    key = rig.script(
        Round(tool_calls=calls(("ask_quick", {"note": "n"}))),
        Round(text="All done."),
    )
    tid = rig.client._start_turn(key).turn_id
    rig.collect(tid, until=lambda e: e.type == "interaction_requested")
    rig.worker("turns").kill()  # the deadline (0.5 s) is in Redis, not in that process
    time.sleep(1.0)
    rig.start("turns")
    events = rig.collect(tid, timeout_s=40)
    types = [e.type for e in events]
    assert types[-1] == "turn_finished", types
    assert types.count("interaction_timed_out") == 1 and types.count("tool_denied") == 1
    denied = rig.client._store.results(tid)
    assert [r.status for r in denied.values()] == ["denied"]
    assert_gapless(rig.log_events(tid))


@pytest.mark.timeout(900)
def test_a_thousand_waiting_turns_are_held_and_aborted_at_once(rig, tmp_path: Path) -> None:
    """Every turn waits on one slow call (a tool worker has 4 processes); one turn worker
    holds them all, with its few threads, and an abort of all ends them quickly."""
    n = 1000
    key = rig.script(
        Round(tool_calls=calls(("counted_unlimited", {"path": str(tmp_path / "x"), "seconds": 30})))
    )
    handles = [rig.client._start_turn(f"{key} {i}") for i in range(n)]
    store = rig.client._store
    # Held = every turn dispatched its call and waits; no turn worker thread holds any.
    wait_for(
        lambda: (
            store.redis.zcard(k.WAKEUPS) == n
            and all(store.state(h.turn_id).get("phase") == "tools" for h in handles[-10:])
        ),
        # 17 s alone on the 2-core VM; beside a full four-process suite run, over 200.
        90 * busy_factor(),
        message="all turns waiting on their call",
    )
    wait_for(
        lambda: sum(1 for h in handles[::50] if store.call_progress(h.turn_id)[1]) == n // 50,
        60,
        message="calls dispatched",
    )
    t0 = time.monotonic()
    for h in handles:
        ended = rig.log_events(h.turn_id)
        assert ended[-1].type not in ("turn_finished", "turn_error"), ended[-1]
        rig.client.abort(h.turn_id, h.token)
    wait_for(lambda: store.redis.zcard(k.WAKEUPS) == 0, 60, message="all ended")
    took = time.monotonic() - t0
    assert took < 60, took
    sample = handles[:: n // 20]
    for h in sample:
        log = rig.log_events(h.turn_id)
        assert log[-1].type == "turn_aborted"
        assert_gapless(log)
        assert_valid_history(rig.client.get(h.turn_id)["history"])
        res = store.results(h.turn_id)
        assert len(res) == 1 and next(iter(res.values())).status in ("cancelled", "ok", "timeout")
