"""A rolling deploy: every worker gets SIGTERM (a deploy's signal) and a new one starts.

A turn worker's warm shutdown hands its turns over at once: the next step runs on the
new worker without waiting for a step lock to lapse (set long here, 30 s, so waiting
for it would show). A tool worker's warm shutdown lets the running call finish: it
settles `ok`, once, instead of `lost`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(180)]

STEP_LOCK_S = 30.0


def _sigterm(proc) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM the worker's main process only, as a deploy would, and wait for it to go."""
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(60)
    proc.stop()  # reaps the group


def test_a_rolling_deploy_hands_turns_over_at_once(make_rig, tmp_path: Path) -> None:
    rig = make_rig(AGENTQ_STEP_LOCK_S=str(STEP_LOCK_S), AGENTQ_TURN_LEASE_S="30")
    rig.start("tools", "llm", "turns")
    count = tmp_path / "count"
    key = rig.script(
        Round(tool_calls=calls(("counted", {"path": str(count), "seconds": 4}))),
        Round(tool_calls=calls(("echo", {"text": "after the deploy"}))),
        Round(text="Finished across the deploy."),
    )
    handles = [rig.client._start_turn(key) for _ in range(3)]
    wait_for(lambda: starts(count) == 3, 30, message="the calls to start")
    old = list(rig.workers)

    # The new generation comes up first, then the old one gets SIGTERM while its
    # tools still run and its turns wait on them.
    rig.start("tools", "llm", "turns")
    t0 = time.monotonic()
    for proc in old:
        _sigterm(proc)
    stopped_s = time.monotonic() - t0

    for h in handles:
        events = rig.collect(h.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished", [e.type for e in events]
        assert events[-1].fields["content"] == "Finished across the deploy."
        finished = [e for e in events if e.type == "tool_finished"]
        # The warm shutdown let the running call finish: ok, not lost.
        assert [e.fields["status"] for e in finished] == ["ok", "ok"], finished
        assert_gapless(rig.log_events(h.turn_id))
        assert_valid_history(rig.client.get(h.turn_id)["history"])
    # Nothing waited for a step lock (30 s) to lapse.
    assert time.monotonic() - t0 < STEP_LOCK_S, stopped_s
    assert starts(count) == 3


def test_a_second_sigterm_does_not_cut_a_warm_shutdown_short(make_rig, tmp_path: Path) -> None:
    """An impatient deploy sends SIGTERM twice: the running call still finishes, once."""
    rig = make_rig()
    rig.start("tools", "llm", "turns")
    count = tmp_path / "count"
    key = rig.script(
        Round(tool_calls=calls(("counted", {"path": str(count), "seconds": 3}))),
        Round(text="Done despite two signals."),
    )
    handle = rig.client._start_turn(key)
    wait_for(lambda: starts(count) == 1, 30, message="the call to start")
    tools = rig.worker("tools")
    os.kill(tools.pid, signal.SIGTERM)
    wait_for(lambda: "Warm shutdown" in tools.log_text(), 10, message="the warm shutdown")
    os.kill(tools.pid, signal.SIGTERM)
    events = rig.collect(handle.turn_id, timeout_s=60)
    assert events[-1].type == "turn_finished", [e.type for e in events]
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["ok"], finished
    assert starts(count) == 1
    # The worker went once its call was done, by itself.
    assert tools.wait(30) == 0
    tools.stop()
