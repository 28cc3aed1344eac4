"""The dispatcher against a real Redis and a real prefork tool worker in its own process."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from agentq.fleet.runtime import get_store
from agentq.local.processes import wait_for
from agentq.models import ToolCall
from tests.helpers import exited
from tests.rigs.rounds import run_round

pytestmark = pytest.mark.integration


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(id=f"c_{uuid.uuid4().hex[:8]}", name=name, arguments=json.dumps(args))


def test_parallel_round_settles_ok_ok_timeout_in_about_the_hard_limit(fleet) -> None:
    calls = [call("echo", text="a"), call("stuck", seconds=30), call("sleep", seconds=0.2)]
    t0 = time.time()
    turn_id, results = run_round(calls)
    took = time.time() - t0
    assert [r.status for r in results] == ["ok", "timeout", "ok"]
    assert [r.call_id for r in results] == [c.id for c in calls]
    assert 1.5 < took < 6, took  # hard limit of `stuck` is 2 s
    assert results[0].content == "a"
    # The fast results settled before the slow one: the event log shows their order.
    finished = [e for e in get_store().bus.replay(turn_id) if e.type == "tool_finished"]
    order = [e.fields["call_id"] for e in finished]
    assert order.index(calls[1].id) == 2
    stuck = results[1]
    assert "killed" in stuck.content and stuck.record.pid
    wait_for(lambda: exited(stuck.record.pid or 0), 5, message="killed child gone")


def test_soft_limit_partial_result_is_used(fleet) -> None:
    _, (res,) = run_round([call("gather", items=100)])
    assert res.status == "ok"
    assert res.record.soft_limited and res.record.partial
    data = json.loads(res.content)
    assert data["complete"] is False and len(data["items"]) > 5


def test_overran_budget_is_ok_with_flag(fleet) -> None:
    _, (res,) = run_round([call("slowpoke", seconds=0.5)])
    assert res.status == "ok" and res.record.overran is True
    assert res.content == "done after 0.5s"
    assert res.record.duration_ms is not None and res.record.duration_ms >= 500


def test_exclusive_never_overlaps(fleet) -> None:
    calls = [
        call("stamp", seconds=0.3),
        call("stamp", seconds=0.3),
        call("exclusive_write", seconds=0.3),
        call("stamp", seconds=0.3),
    ]
    _, results = run_round(calls)
    assert all(r.status == "ok" for r in results)
    spans = [json.loads(r.content) for r in results]
    ex = spans[2]
    for i in (0, 1, 3):
        other = spans[i]
        assert other["end"] <= ex["start"] or other["start"] >= ex["end"], (i, spans)
    # The two parallel calls before it did overlap each other.
    assert spans[0]["start"] < spans[1]["end"] and spans[1]["start"] < spans[0]["end"]


def test_bad_input_settles_as_error_without_reaching_a_worker(fleet) -> None:
    calls = [
        ToolCall(id="bad_json", name="echo", arguments="{not json"),
        ToolCall(id="unknown", name="nope", arguments="{}"),
        ToolCall(id="wrong_type", name="sleep", arguments='{"seconds": "soon"}'),
        ToolCall(id="missing", name="echo", arguments="{}"),
        ToolCall(id="extra", name="echo", arguments='{"text": "a", "other": 1}'),
        ToolCall(id="huge", name="echo", arguments=json.dumps({"text": "x" * 2_000_000})),
        ToolCall(id="good", name="echo", arguments='{"text": "fine"}'),
        ToolCall(id="raises", name="fail", arguments='{"message": "kaput"}'),
        ToolCall(id="big", name="big", arguments='{"size_bytes": 200000}'),
    ]
    results = {r.call_id: r for r in run_round(calls)[1]}
    assert "not valid JSON" in (results["bad_json"].error or "")
    assert "unknown tool 'nope'" in (results["unknown"].error or "")
    assert "seconds" in (results["wrong_type"].error or "")
    assert (
        "text" in (results["missing"].error or "")
        and "required" in (results["missing"].error or "").lower()
    )
    assert "other" in (results["extra"].error or "")
    assert "bytes" in (results["huge"].error or "")
    assert results["good"].status == "ok" and results["good"].content == "fine"
    assert results["raises"].status == "error" and "kaput" in (results["raises"].error or "")
    assert results["big"].status == "ok" and results["big"].truncated_bytes > 0
    assert "cut" in results["big"].content[-100:]
    for cid in ("bad_json", "unknown", "wrong_type", "missing", "extra", "huge"):
        assert results[cid].status == "error"
        assert results[cid].record.task_id is None  # never sent to a worker


def test_meta_timeout_hint_is_clamped_and_stripped(fleet) -> None:
    c = call("sleep", seconds=0.1, _meta={"timeout_s": 9999})
    _, (res,) = run_round([c])
    assert res.status == "ok"
    assert res.record.timeout_s == 30  # clamped to the tool's ceiling
