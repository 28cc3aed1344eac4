"""A turn worker SIGKILLed mid-round: the other turn worker's reaper resumes the turn."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentq import constants as k
from agentq.testing.openai_server import Round
from agentq.testing.processes import wait_for
from tests.faults.rig import assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]

# Two turn workers: whichever holds the turn is killed, the other one resumes it.
RIG_WORKERS = ("tools", "llm", "turns", "turns")
LEASE_S = 1.5


def test_killed_turn_worker_is_resumed_elsewhere_without_rerunning_calls(
    rig, tmp_path: Path
) -> None:
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
    handle = rig.client.start_turn(key)
    tid = handle.turn_id
    seen: set[str] = set()

    def progressed(e) -> bool:  # type: ignore[no-untyped-def]
        if e.type in ("tool_finished", "tool_started"):
            seen.add(e.type)
        return seen == {"tool_finished", "tool_started"} and starts(slow) == 1

    rig.collect(tid, until=progressed)
    wait_for(lambda: starts(fast) == 1 and starts(slow) == 1, 10)
    holder = rig.client.store.lease_holder(tid)
    assert holder is not None
    pid = int(holder.split(":")[1])
    victim = next(w for w in rig.workers if w.pid == pid)
    victim.kill()
    killed_at = time.monotonic()

    events = rig.collect(tid, timeout_s=40)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == "All done."
    resumed = [e for e in events if e.type == "turn_resumed"]
    assert len(resumed) == 1 and str(pid) not in resumed[0].fields["worker"]
    # Resumed within a lease lapse plus a reaper sweep or two (generous bound).
    assert resumed[0].ts - (time.time() - (time.monotonic() - killed_at)) < 3 * LEASE_S + 2
    # No finished call ran again, and the call in flight was not sent twice.
    assert (starts(fast), starts(slow), starts(later)) == (1, 1, 1)
    statuses = [e.fields["status"] for e in events if e.type == "tool_finished"]
    assert statuses == ["ok", "ok", "ok"]
    # The whole log: seq 1..n with nothing missing or repeated.
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
    assert not rig.client.store.redis.exists(k.lease_key(tid))
