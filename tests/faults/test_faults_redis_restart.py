"""Redis restarted mid-turn, on the same port.

With an append-only file (the production setup of compose/docker-compose.yml) the turn
survives: workers and clients reconnect and the turn finishes with every call settled
once. Without persistence the restart wipes every turn: the running turn must end with
a clear error, never write half a turn back, and the next turn must work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentq import constants as k
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import assert_gapless, assert_valid_history, calls, starts

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(120)]


def _turn_mid_tool(rig, count: Path) -> str:  # type: ignore[no-untyped-def]
    key = rig.script(
        Round(tool_calls=calls(("counted", {"path": str(count), "seconds": 3}))),
        Round(text="Finished after the restart."),
    )
    handle = rig.client._start_turn(key)
    rig.collect(handle.turn_id, until=lambda e: e.type == "tool_started")
    wait_for(lambda: starts(count) == 1, 10, message="the tool to start")
    return handle.turn_id


def test_turn_survives_a_restart_of_a_persistent_redis(make_rig, tmp_path: Path) -> None:
    rig = make_rig(appendonly=True)
    rig.start("tools", "llm", "turns")
    count = tmp_path / "count"
    tid = _turn_mid_tool(rig, count)
    follower, seen = rig.follow(tid)
    wait_for(lambda: any(e.type == "tool_started" for e in seen), 5)
    rig.redis.restart()

    follower.join(45)
    assert not follower.is_alive()
    # The client that was following reconnected and missed nothing.
    assert seen[-1].type == "turn_finished", [e.type for e in seen]
    assert seen[-1].fields["content"] == "Finished after the restart."
    assert_gapless(seen)
    assert [e.fields["status"] for e in seen if e.type == "tool_finished"] == ["ok"]
    assert starts(count) == 1
    log = rig.log_events(tid)
    assert [e.seq for e in log] == [e.seq for e in seen]
    assert_valid_history(rig.client.get(tid)["history"])
    again = rig.client._start_turn(rig.script(Round(tool_calls=calls(("echo", {"text": "x"})))))
    assert rig.collect(again.turn_id)[-1].type == "turn_finished"

    # Workers consume without kombu's unacked hash: the restart left nothing to hand back.
    assert rig.client._store.redis.hlen("unacked") == 0
    assert starts(count) == 1
    assert [e.seq for e in rig.log_events(tid)] == [e.seq for e in log]


def test_turn_fails_clearly_when_redis_loses_everything(make_rig, tmp_path: Path) -> None:
    rig = make_rig(appendonly=False)
    rig.start("tools", "llm", "turns")
    count = tmp_path / "count"
    tid = _turn_mid_tool(rig, count)
    # A client already following the turn, as `agentq run` would be.
    follower, seen = rig.follow(tid)
    wait_for(lambda: any(e.type == "tool_started" for e in seen), 5)
    rig.redis.restart()  # no AOF: every key is gone

    follower.join(45)
    assert not follower.is_alive()
    assert seen[-1].type == "turn_error", [e.type for e in seen]
    assert seen[-1].fields["code"] == "state_lost"
    assert "lost this turn's state" in seen[-1].fields["error"]
    turn = rig.client.get(tid)
    assert turn["state"]["status"] == "error" and turn["state"]["error_code"] == "state_lost"
    assert turn["history"] == [] and turn["invocations"] == []
    # The tool still finishes its sleep: its result must not resurrect the turn.
    tools = rig.worker("tools")
    wait_for(
        lambda: (
            "its turn is over or gone" in tools.log_text()
            or "succeeded" in tools.log_text().split("counted[", 2)[-1]
        ),
        15,
        interval_s=0.1,
    )
    redis = rig.client._store.redis
    keys = [kk.decode() for kk in redis.scan_iter(match=k.turn_key(tid) + "*")]
    assert keys and all(redis.ttl(kk) > 0 for kk in keys), {kk: redis.ttl(kk) for kk in keys}
    log = rig.log_events(tid)
    assert log[-1].type == "turn_error"  # nothing after the terminal event
    # The late result recreated nothing of the turn: no call of it is recorded.
    assert not [f for f in redis.hkeys(k.turn_key(tid)) if f.decode()[:2] in k.CALL_RECORDS]
    assert starts(count) == 1
    again = rig.client._start_turn(rig.script(Round(tool_calls=calls(("echo", {"text": "x"})))))
    assert rig.collect(again.turn_id)[-1].type == "turn_finished"
