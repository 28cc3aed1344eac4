"""Redis behind Sentinel: every process reaches it through `sentinel://` URLs only, and a
failover (`SENTINEL FAILOVER`) mid-turn costs nothing: turns finish, every call gets
exactly one result, no call runs twice, and the event logs have no seq gap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.faults.rig import FAULT_TOOLS
from tests.helpers import assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(180)]


def test_turns_finish_across_sentinel_failovers(make_rig, tmp_path: Path) -> None:
    rig = make_rig(
        sentinel=True, appendonly=True, AGENTQ_TOOLS=f"{FAULT_TOOLS},agentq.testing.aio_tools"
    )
    assert rig.env["AGENTQ_REDIS_URL"].startswith("sentinel://")
    assert rig.env["AGENTQ_REDIS_URL"].count("sentinel://") == 3
    rig.start("tools", "llm", "turns", "io")
    first_master = rig.cluster.master_port()

    counts = [tmp_path / f"count{i}" for i in range(4)]
    key = rig.script(
        Round(
            tool_calls=calls(
                ("counted", {"path": str(counts[0]), "seconds": 2}),
                ("counted", {"path": str(counts[1]), "seconds": 0.2}),
                ("aio_sleep", {"seconds": 1.5}),
            )
        ),
        Round(tool_calls=calls(("counted", {"path": str(counts[2]), "seconds": 0.5}))),
        Round(text="Finished across failovers."),
    )
    handles = [rig.client._start_turn(key) for _ in range(3)]
    follower, seen = rig.follow(handles[0].turn_id, timeout_s=90)
    wait_for(lambda: starts(counts[0]) == 3, 30, message="the slow calls to start")

    second_master = rig.cluster.failover()
    assert second_master != first_master
    # A second failover while the second round runs: back to the first server.
    wait_for(lambda: starts(counts[2]) >= 1, 30, message="the second round to start")
    assert rig.cluster.failover() == first_master

    follower.join(90)
    assert not follower.is_alive()
    assert seen[-1].type == "turn_finished", [e.type for e in seen]
    for h in handles:
        events = rig.collect(h.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished", [e.type for e in events]
        assert events[-1].fields["content"] == "Finished across failovers."
        log = rig.log_events(h.turn_id)
        assert_gapless(log)
        finished = [e.fields["call_id"] for e in log if e.type == "tool_finished"]
        assert len(finished) == len(set(finished)) == 4, finished
        settled = [e.fields for e in log if e.type == "tool_finished"]
        assert all(f["status"] == "ok" for f in settled), settled
        assert_valid_history(rig.client.get(h.turn_id)["history"])
    # Every non-idempotent call ran once per turn: three turns, one line each.
    assert [starts(p) for p in counts[:3]] == [3, 3, 3]


def test_a_sentinel_url_without_master_name_fails_at_start() -> None:
    env = {
        "AGENTQ_REDIS_URL": "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2/0",
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(
        [sys.executable, "-m", "agentq", "worker", "turns"],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert b"AGENTQ_REDIS_SENTINEL_MASTER" in out.stderr, out.stderr[-2000:]
