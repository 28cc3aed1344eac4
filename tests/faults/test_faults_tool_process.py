"""A tool's pool process SIGKILLed from outside, mid-call: the call settles, the turn goes on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from agentq import constants as k
from agentq.fleet import runtime
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli, assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]


def _started(rig, turn_id: str, tool: str):  # type: ignore[no-untyped-def]
    """Follow the turn until `tool` starts; return that tool_started event."""
    events = rig.collect(
        turn_id, until=lambda e: e.type == "tool_started" and e.fields["tool"] == tool
    )
    assert events[-1].type == "tool_started", [e.type for e in events]
    return events[-1]


def test_killed_pool_process_settles_lost_and_the_turn_finishes(rig, tmp_path: Path) -> None:
    count = tmp_path / "count"
    key = rig.script(
        Round(
            tool_calls=calls(
                ("counted", {"path": str(count), "seconds": 30}), ("echo", {"text": "sibling"})
            )
        ),
        Round(text="Recovered."),
    )
    handle = rig.client._start_turn(key)
    started = _started(rig, handle.turn_id, "counted")
    pid = int(started.fields["pid"])
    tool_worker = rig.worker("tools")
    assert pid in tool_worker.children_pids()
    wait_for(lambda: starts(count) == 1, 10, message="the tool to start its work")
    os.kill(pid, signal.SIGKILL)

    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    finished = {e.fields["tool"]: e for e in events if e.type == "tool_finished"}
    assert finished["counted"].fields["status"] == "lost"
    assert finished["echo"].fields["status"] == "ok"
    assert_gapless(events)
    turn = rig.client.get(handle.turn_id)
    assert_valid_history(turn["history"])
    assert starts(count) == 1  # lost, not run again
    # The pool replaced its dead process and the worker is still serving.
    assert tool_worker.is_running() and not psutil.pid_exists(pid)
    again = rig.client._start_turn(rig.script(Round(tool_calls=calls(("echo", {"text": "x"})))))
    assert rig.collect(again.turn_id)[-1].type == "turn_finished"


def test_killed_idempotent_call_is_run_again_and_succeeds(rig, tmp_path: Path) -> None:
    count = tmp_path / "count"
    key = rig.script(
        Round(tool_calls=calls(("counted_idempotent", {"path": str(count), "seconds": 1}))),
        Round(text="Done."),
    )
    handle = rig.client._start_turn(key)
    first = _started(rig, handle.turn_id, "counted_idempotent")
    wait_for(lambda: starts(count) == 1, 10, message="the first attempt to start")
    os.kill(int(first.fields["pid"]), signal.SIGKILL)

    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    started = [e for e in events if e.type == "tool_started"]
    finished = [e for e in events if e.type == "tool_finished"]
    assert len(started) == 2 and started[0].fields["pid"] != started[1].fields["pid"]
    assert [e.fields["status"] for e in finished] == ["ok"]
    assert starts(count) == 2  # the kill, then exactly one retry
    assert_gapless(events)
    assert_valid_history(rig.client.get(handle.turn_id)["history"])


def test_abort_from_a_command_that_exits_kills_a_tool_that_ignores_sigterm(
    rig, tmp_path: Path
) -> None:
    # `agentq abort` exits as soon as the turn says cancelled; the SIGKILL after the grace
    # must still come (from the turn workers' sweepers), or the tool runs on to its limit.
    count = tmp_path / "count"
    key = rig.script(Round(tool_calls=calls(("stubborn", {"path": str(count)}))))
    handle = rig.client._start_turn(key)
    pid = int(_started(rig, handle.turn_id, "stubborn").fields["pid"])
    wait_for(lambda: starts(count) == 1, 10, message="the tool to ignore SIGTERM")
    out = agentq_cli(rig.env, "abort", handle.turn_id)
    assert out.returncode == 0, out.stderr
    aborted = time.monotonic()
    assert rig.collect(handle.turn_id)[-1].type == "turn_aborted"
    # The kill grace (0.5 s here) plus a sweep (0.25 s), with room for a busy machine.
    wait_for(lambda: not psutil.pid_exists(pid), 10, message="the stubborn tool killed")
    assert time.monotonic() - aborted < 10
    assert runtime.get_store().redis.zcard(k.KILLS) == 0
