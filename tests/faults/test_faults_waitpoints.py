"""Completions of waitpoints sent while the fleet breaks: every turn worker killed, Redis
restarted (append-only file). A completion is the call's settle: stored once, with the turn
woken in the same script, so none is lost and none is applied twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agentq.errors import REDIS_ERRORS, WaitpointRefused
from agentq.events import Event
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli, assert_gapless, assert_valid_history, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(180)]

TURNS = 8


def _waiting_turns(rig: Any) -> list[tuple[str, str, str]]:  # (turn id, waitpoint id, token)
    key = rig.script(
        Round(tool_calls=calls(("await_callback", {"timeout_s": 120}))),
        Round(text="completed"),
    )
    ids = [rig.client._start_turn(f"{key} #{i}").turn_id for i in range(TURNS)]
    out = []
    for tid in ids:
        ev = rig.collect(tid, until=lambda e: e.type == "tool_waiting")[-1]
        wp_id = str(ev.fields["waitpoint_id"])
        token = str(ev.fields["callback_url"]).split("token=", 1)[1]
        out.append((tid, wp_id, token))
    return out


def _complete(rig: Any, wp_id: str, token: str, value: Any, until_s: float = 60) -> str:
    """Send a completion as a careful sender would: again after an error, until it gets an
    answer; "ok", or "first" when a completion (maybe its own, whose answer was lost)
    was stored first."""
    deadline = time.monotonic() + until_s
    while True:
        try:
            rig.client.complete_waitpoint(wp_id, token, value)
            return "ok"
        except WaitpointRefused as exc:
            assert exc.status_code == 409 and exc.first is not None, exc.message
            assert exc.first["content"] == f'{{"n": {value["n"]}}}', exc.first
            return "first"
        except REDIS_ERRORS:
            assert time.monotonic() < deadline, f"{wp_id}: Redis never came back"
            time.sleep(0.2)


def _check_once(rig: Any, turns: list[tuple[str, str, str]]) -> None:
    for i, (tid, _, _) in enumerate(turns):
        events: list[Event] = rig.collect(tid, timeout_s=60)
        assert events[-1].type == "turn_finished", (tid, events[-1])
        finished = [e for e in events if e.type == "tool_finished"]
        assert [e.fields["status"] for e in finished] == ["ok"], tid
        log = rig.log_events(tid)
        assert_gapless(log)
        history = rig.client.get(tid)["history"]
        assert_valid_history(history)
        tool = [m for m in history if m["role"] == "tool"]
        assert [m["content"] for m in tool] == [f'{{"n": {i}}}'], tid


def _in_threads(jobs: list[Callable[[], str]]) -> tuple[list[threading.Thread], list[str]]:
    got: list[str] = []
    threads = [threading.Thread(target=lambda j=j: got.append(j()), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    return threads, got


def test_completions_while_every_turn_worker_is_killed_are_applied_once(make_rig) -> None:
    rig = make_rig()
    rig.start("tools", "llm", "turns")
    turns = _waiting_turns(rig)
    threads, got = _in_threads(
        [lambda a=a, i=i: _complete(rig, a[1], a[2], {"n": i}) for i, a in enumerate(turns)]
    )
    rig.worker("turns").kill()
    for t in threads:
        t.join(30)
    assert sorted(got) == ["ok"] * TURNS
    # Another completion, from another process: the first is kept.
    _, wp_id, token = turns[0]
    again = agentq_cli(
        rig.env, "waitpoint", "complete", wp_id, "--token", token, "--json", '{"n": 99}'
    )
    assert again.returncode == 1 and "completed already" in again.stderr
    rig.start("turns")
    _check_once(rig, turns)


def test_completions_across_a_redis_restart_are_never_lost_nor_doubled(make_rig) -> None:
    rig = make_rig(appendonly=True)
    rig.start("tools", "llm", "turns")
    turns = _waiting_turns(rig)
    # Half before the restart, half sent while Redis is away (each retried until answered).
    for i, (_, wp_id, token) in enumerate(turns[: TURNS // 2]):
        assert _complete(rig, wp_id, token, {"n": i}) == "ok"
    rig.redis.halt()  # SIGTERM: it writes its AOF, and start() brings it back
    threads, got = _in_threads(
        [
            lambda a=a, i=i: _complete(rig, a[1], a[2], {"n": i})
            for i, a in enumerate(turns)
            if i >= TURNS // 2
        ]
    )
    rig.redis.start()
    for t in threads:
        t.join(60)
    assert len(got) == TURNS - TURNS // 2 and set(got) <= {"ok", "first"}
    # The first half again, after the restart: the AOF kept them.
    for i, (_, wp_id, token) in enumerate(turns[: TURNS // 2]):
        assert _complete(rig, wp_id, token, {"n": i}) == "first"
    _check_once(rig, turns)
    wps = rig.client._store
    wait_for(lambda: all(not wps.open_waitpoints(t) for t, _, _ in turns), 10)
