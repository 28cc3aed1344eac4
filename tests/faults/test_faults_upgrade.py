"""An upgrade across a change of how a turn is kept in Redis (docs/operations.md,
"Upgrading a fleet"): the older workers are stopped, the newer ones start and go on with
the turns the older ones left, from what those kept."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from agentq import constants as k
from agentq.models import AssistantMessage, ToolCall, ToolResult
from agentq.orchestrator.plan import plan_call
from agentq.state.layout import LAYOUT, LAYOUT_KEY
from agentq.testing.openai_server import Round
from agentq.tools.results import record_for
from tests.helpers import calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_turn_an_older_layout_left_mid_round_goes_on_from_its_records(make_rig) -> None:
    """The older versions kept a turn's call records in `{turn}:calls` and its history in
    `{turn}:history`. A turn they left with its round's only call settled, the round not
    collected yet, goes on under the newer workers from that result and that history: the
    first of them moves both into the turn's state before it takes a task. Had the
    records stayed where they were, the step would find the call never planned and send
    it again (with no tool worker here the turn would wait); had the history, the model
    would be asked with no messages."""
    rig = make_rig()
    # The model's first round (the call) was streamed under the older workers.
    key = rig.script(
        Round(tool_calls=calls(("echo", {"text": "x"}))), Round(text="Went on after the upgrade.")
    )
    store = rig.client._store
    turn_id = secrets.token_hex(16)
    call = ToolCall(id="call_old_1", name="echo", arguments='{"text": "x"}')
    now = time.time()
    history = [{"role": "user", "content": key}, AssistantMessage(tool_calls=(call,)).to_openai()]
    state = {
        "status": "running",
        "created_at": now - 5,
        "started_at": now - 5,
        "round": 1,
        "call_count": 1,
        "phase": "tools",
        "round_calls": [call.id],
        k.UNSETTLED_FIELD: 0,
    }
    store.create(turn_id, state, [])
    store.redis.rpush(k.turn_key(turn_id) + ":history", *[json.dumps(m) for m in history])
    result = ToolResult(
        call_id=call.id,
        tool=call.name,
        status="ok",
        content='"kept by the older worker"',
        record=record_for(call, "ok", task_id="old-task", started_at=now - 2),
    )
    older = {
        k.PLANNED + call.id: plan_call(call).model_dump_json(),
        k.DISPATCHED + call.id: json.dumps({"task_id": "old-task", "dispatched_at": now - 3}),
        k.STARTED + call.id: json.dumps({"started_at": now - 2, "worker": "old@host"}),
        k.SETTLED + call.id: result.model_dump_json(),
    }
    store.redis.hset(k.turn_key(turn_id) + ":calls", mapping=older)
    # Its settle woke it: due now, for the first sweep of a newer turn worker.
    store.redis.zadd(k.turn_wakeups_key(turn_id), {turn_id: now})
    assert store.redis.get(LAYOUT_KEY) is None

    rig.start("llm", "turns")
    events = rig.collect(turn_id, timeout_s=60)
    assert events[-1].type == "turn_finished", [e.type for e in events]
    assert not [e for e in events if e.type == "tool_started"]  # the call did not run again
    turn = rig.client.get(turn_id)
    assert [m["role"] for m in turn["history"]] == ["user", "assistant", "tool", "assistant"]
    assert turn["history"][2]["content"] == '"kept by the older worker"'
    assert turn["history"][-1]["content"] == "Went on after the upgrade."
    assert [r["status"] for r in turn["invocations"]] == ["ok"]
    assert not store.redis.exists(k.turn_key(turn_id) + ":calls")
    assert not store.redis.exists(k.turn_key(turn_id) + ":history")
    assert int(store.redis.get(LAYOUT_KEY) or 0) == LAYOUT
