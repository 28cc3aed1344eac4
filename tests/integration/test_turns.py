"""Whole turns through real turn, stream and tool workers and the scripted model server."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from agentq.api import Client
from agentq.errors import TurnNotFound
from agentq.events import Event
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import assert_valid_history, calls, collect, script

pytestmark = pytest.mark.integration


def test_turn_runs_tools_and_answers(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(
            text="Working.", tool_calls=calls(("echo", {"text": "hi"}), ("sleep", {"seconds": 0.3}))
        ),
        Round(text="All done."),
    )
    handle = client._start_turn(f"{key} please")
    events = collect(client, handle.turn_id)
    types = [e.type for e in events]
    assert types[0] == "turn_started" and types[-1] == "turn_finished"
    for t in ("llm_started", "llm_delta", "llm_finished", "tool_started", "tool_finished"):
        assert t in types, t
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    finished = [e for e in events if e.type == "tool_finished"]
    assert {e.fields["status"] for e in finished} == {"ok"}
    assert events[-1].fields["content"] == "All done."
    turn = client.get(handle.turn_id)
    history = turn["history"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    assert history[2]["content"] == "hi"
    assert_valid_history(history)
    assert turn["state"]["status"] == "finished"
    assert {r["status"] for r in turn["invocations"]} == {"ok"}


def test_abort_kills_the_stuck_tool_and_keeps_the_sibling(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}), ("echo", {"text": "fast"})))
    )
    handle = client._start_turn(key)
    tid = handle.turn_id
    seen: dict[str, Event] = {}
    for ev in client.events(tid, heartbeat_s=0.5):
        if ev is None:
            continue
        if ev.type == "tool_started" and ev.fields["tool"] == "hang":
            seen["hang"] = ev
        if ev.type == "tool_finished" and ev.fields["tool"] == "echo":
            seen["echo"] = ev
        if len(seen) == 2:
            break
    pid = int(seen["hang"].fields["pid"])
    assert psutil.pid_exists(pid)
    t0 = time.monotonic()
    client.abort(tid, handle.token)
    aborted = None
    for ev in client.events(tid, heartbeat_s=0.5):
        if ev is not None and ev.type == "turn_aborted":
            aborted = time.monotonic()
            break
    assert aborted is not None and aborted - t0 < 3.0, aborted and aborted - t0
    wait_for(lambda: not psutil.pid_exists(pid), 5, message=f"tool process {pid} gone")
    turn = client.get(tid)
    assert turn["state"]["status"] == "aborted"
    history = turn["history"]
    assert_valid_history(history)
    by_id = {m["tool_call_id"]: m for m in history if m["role"] == "tool"}
    statuses = {r["call_id"]: r["status"] for r in turn["invocations"]}
    hang_id = seen["hang"].fields["call_id"]
    echo_id = seen["echo"].fields["call_id"]
    assert statuses == {hang_id: "cancelled", echo_id: "ok"}
    assert by_id[echo_id]["content"] == "fast"
    assert json.loads(by_id[hang_id]["content"])["status"] == "cancelled"
    # Aborting twice is harmless: the turn is over, so the answer is "not found".
    with pytest.raises(TurnNotFound):
        client.abort(tid, handle.token)


def test_killed_tool_process_settles_lost_and_turn_goes_on(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("die", {"seconds": 0.1}), ("echo", {"text": "ok"}))),
        Round(text="Recovered."),
    )
    handle = client._start_turn(key)
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished"
    statuses = {e.fields["tool"]: e.fields["status"] for e in events if e.type == "tool_finished"}
    assert statuses == {"die": "lost", "echo": "ok"}
    assert_valid_history(client.get(handle.turn_id)["history"])


def test_idempotent_tool_is_retried_after_its_process_died(
    fleet, llm_server, client: Client, tmp_path
) -> None:
    marker = tmp_path / "marker"
    key = script(
        llm_server, Round(tool_calls=calls(("die_once", {"marker": str(marker)}))), Round(text="ok")
    )
    handle = client._start_turn(key)
    events = collect(client, handle.turn_id)
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["ok"]
    assert marker.exists()  # the first attempt really ran and died
    started = [e for e in events if e.type == "tool_started"]
    assert len(started) == 2


def test_loop_detector_and_call_limit_end_the_turn_cleanly(
    fleet, llm_server, client: Client
) -> None:
    same = calls(("echo", {"text": "again"}))
    key = script(llm_server, *[Round(tool_calls=same) for _ in range(5)])
    handle = client._start_turn(key)
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1].fields
    assert events[-1].fields["reason"] == "loop_detected"
    history = client.get(handle.turn_id)["history"]
    assert_valid_history(history)
    assert "loop detector" in history[-1]["content"]


def test_model_failure_is_a_turn_error_with_a_code(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(fault="http_400", fault_message="model says no"))
    handle = client._start_turn(key)
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_error"
    assert "model says no" in events[-1].fields["error"]


def test_aborting_a_parent_aborts_its_sub_agents(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    parent = client._start_turn(key)
    child = client._start_turn(key, parent_turn_id=parent.turn_id)
    for h in (parent, child):
        wait_for(
            lambda h=h: any(
                t["turn_id"] == h.turn_id and t["current_tools"] for t in client.active()
            ),
            20,
            message="both turns running a tool",
        )
    client.abort(parent.turn_id, parent.token)
    for h in (parent, child):
        last = collect(client, h.turn_id)[-1]
        assert last.type == "turn_aborted", (h, last)
        assert_valid_history(client.get(h.turn_id)["history"])


def test_an_abort_whose_sender_died_before_its_step_is_taken(
    fleet, llm_server, client: Client
) -> None:
    """The abort's one write (flag, reason, wakeup) is durable on its own: a sender that
    died before it sent the step (as `flag_cancel` alone leaves it) is followed by the
    sweeper, which takes the abort step at the wakeup."""
    from agentq.fleet import runtime

    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    handle = client._start_turn(key)
    collect(client, handle.turn_id, until=lambda e: e.type == "tool_started")
    woken, _ = runtime.get_store().flag_cancel(handle.turn_id, "user")  # no step sent
    assert woken
    events = collect(client, handle.turn_id, timeout_s=30)
    assert events[-1].type == "turn_aborted" and events[-1].fields["reason"] == "user"
    assert_valid_history(client.get(handle.turn_id)["history"])


def test_abort_while_the_model_streams_leaves_nothing_after_the_end(
    fleet, llm_server, client: Client
) -> None:
    """The stream worker goes on a moment after the abort: none of its writes may land."""
    from agentq import constants as k

    key = script(llm_server, Round(text="x" * 400, chunk_size=2, chunk_delay_ms=50))
    handle = client._start_turn(key)
    tid = handle.turn_id
    for ev in client.events(tid, heartbeat_s=0.5):
        if ev is not None and ev.type == "llm_delta":
            break
    client.abort(tid, handle.token)
    events = collect(client, tid)
    assert events[-1].type == "turn_aborted"
    store = client._store
    # The stream worker has let the round go: it stopped renewing its lease, which lapses.
    from agentq.state.base import now_ms

    def released() -> bool:
        return not k.llm_alive(store.redis.hget(k.turn_key(tid), k.LLM_ALIVE_FIELD), 0, now_ms())

    wait_for(released, 25, message="round released")
    log = store.bus.replay(tid)
    assert log[-1].type == "turn_aborted", [e.type for e in log[-3:]]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    keys = [kk.decode() for kk in store.redis.scan_iter(match=k.turn_key(tid) + "*")]
    assert keys, "the turn's keys are kept for their retention"
    without_ttl = [kk for kk in keys if store.redis.ttl(kk) < 0]
    assert not without_ttl, without_ttl
