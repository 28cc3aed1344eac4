"""Async tools on `agentq worker io`: a real Redis, a real worker process, one event loop."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import psutil
import pytest

from agentq import constants as k
from agentq.fleet.runtime import get_app, get_store
from agentq.local.processes import wait_for
from agentq.models import ToolCall, ToolTaskRequest
from agentq.tools.registry import get_tool
from tests.rigs.rounds import run_round

pytestmark = pytest.mark.integration


def _turn() -> str:
    """A running turn that this test plays: it holds the step lock, so no turn worker
    steps the turn while the test sends its calls by hand."""
    store = get_store()
    turn_id = uuid.uuid4().hex
    store.create(turn_id, {"status": "running"}, [{"role": "user", "content": "x"}])
    assert store.lock_step(turn_id, "test", 600_000)
    return turn_id


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(id=f"c_{uuid.uuid4().hex[:8]}", name=name, arguments=json.dumps(args))


def test_async_tool_ok_with_progress_from_tool_and_worker(io_worker, turn_worker) -> None:
    c = call("aio_sleep", seconds=2.3)
    turn_id, (res,) = run_round([c])
    assert res.status == "ok", res
    data = json.loads(res.content)
    assert 2.2 < data["slept_s"] < 3.5
    assert data["pid"] in [io_worker.pid, *io_worker.children_pids()]
    events = get_store().bus.replay(turn_id)
    progress = [e for e in events if e.type == "tool_progress" and e.fields.get("call_id") == c.id]
    by_tool = [e for e in progress if e.fields["source"] == "tool"]
    by_worker = [e for e in progress if e.fields["source"] == "worker"]
    assert by_tool and by_tool[0].fields["message"] == "waiting"
    # The test settings tick every second.
    assert len(by_worker) >= 2, progress
    assert all(e.fields["state"] == "running" for e in by_worker)
    elapsed = [e.fields["elapsed_ms"] for e in by_worker]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 1900
    start = get_store().call_progress(turn_id)[0][c.id]
    assert start["heartbeat"] is True and start["worker"].startswith("io-")
    assert {"pid", "started_at", "task_id", "attempt", "delivery"} <= set(start)


def test_flower_sees_the_progress_of_long_calls_only(io_worker, turn_worker) -> None:
    from celery.result import AsyncResult

    long, short = call("aio_two_steps", seconds=0.8), call("aio_sleep", seconds=0.05)
    turn_id, results = run_round([long, short])
    assert [r.status for r in results] == ["ok", "ok"], results

    def backend(c: ToolCall) -> AsyncResult:
        return AsyncResult(f"{turn_id}.{c.id}.1", app=get_app())

    # A report once the call has run FLOWER_PROGRESS_S is a PROGRESS state in Flower;
    # one in a call's first moments is not written (most calls are over by then).
    assert backend(long).state == "PROGRESS"
    assert backend(long).info["message"] == "second step"
    assert backend(short).state == "PENDING"
    tool_reports = [
        e.fields["message"]
        for e in get_store().bus.replay(turn_id)
        if e.type == "tool_progress" and e.fields["source"] == "tool"
    ]
    assert sorted(tool_reports) == ["first step", "second step", "waiting"]


def test_hard_limit_cancels_and_settles_timeout(io_worker, turn_worker) -> None:
    t0 = time.time()
    _turn_id, (res,) = run_round([call("aio_stuck", seconds=30)])
    took = time.time() - t0
    assert res.status == "timeout"
    assert "cancelled at its hard time limit of 1s" in (res.error or "")
    assert 0.9 < took < 3.0, took
    assert res.record.duration_ms is not None and 950 <= res.record.duration_ms < 1500


def test_soft_limit_returns_partial(io_worker, turn_worker) -> None:
    _turn_id, (res,) = run_round([call("aio_gather", items=100)])
    assert res.status == "ok", res
    assert res.record.soft_limited and res.record.partial
    data = json.loads(res.content)
    assert data["complete"] is False and data["soft"] is True and 3 <= len(data["items"]) < 20


def test_soft_limit_not_caught_settles_timeout_soft(io_worker, turn_worker) -> None:
    _turn_id, (res,) = run_round([call("aio_ignore_soft", seconds=1.5)])
    assert res.status == "timeout" and res.record.soft_limited
    assert "soft time limit" in (res.error or "")


def test_exception_and_bad_arguments_settle_error(io_worker, turn_worker) -> None:
    calls = [
        call("aio_fail", message="kaput"),
        ToolCall(id="wrong", name="aio_sleep", arguments='{"seconds": "soon"}'),
        call("aio_echo", text="fine"),
    ]
    _turn_id, listed = run_round(calls)
    results = {r.call_id: r for r in listed}
    failed = results[calls[0].id]
    assert failed.status == "error" and "RuntimeError: kaput" in (failed.error or "")
    assert results["wrong"].status == "error" and "seconds" in (results["wrong"].error or "")
    assert results[calls[2].id].status == "ok" and results[calls[2].id].content == "fine"


def test_bad_arguments_reaching_the_worker_settle_error(io_worker) -> None:
    """Arguments the dispatcher would refuse, sent straight to the task: the worker checks too."""
    turn_id = _turn()
    req = ToolTaskRequest(
        turn_id=turn_id,
        call_id="direct",
        tool="aio_sleep",
        arguments={"seconds": "never"},
        timeout_s=5,
        soft_timeout_s=None,
        budget_s=1,
    )
    get_app().send_task("agentq.tool.aio_sleep", kwargs=req.model_dump(), queue=k.QUEUE_IO)
    res = wait_for(lambda: get_store().result(turn_id, "direct"), 10, message="settled")
    assert res.status == "error" and "seconds" in (res.error or "")


def test_abort_cancels_within_50_ms(io_worker) -> None:
    turn_id = _turn()
    c = call("aio_cancellable", seconds=30)
    spec = get_tool("aio_cancellable")
    req = ToolTaskRequest(
        turn_id=turn_id,
        call_id=c.id,
        tool=c.name,
        arguments={"seconds": 30},
        timeout_s=spec.policy.timeout_s,
        soft_timeout_s=None,
        budget_s=1,
    )
    get_app().send_task(spec.task_name, kwargs=req.model_dump(), queue=spec.policy.queue)
    wait_for(lambda: c.id in get_store().call_progress(turn_id)[0], 10, message="call started")
    time.sleep(0.2)
    store = get_store()
    t0 = time.time()
    store.redis.set(k.turn_key(turn_id, "cancel"), "user")
    store.redis.publish(k.CANCEL_CHANNEL, turn_id)

    def cancelled_progress() -> Any:
        return [
            e
            for e in store.bus.replay(turn_id)
            if e.type == "tool_progress" and e.fields.get("message") == "cancelled"
        ]

    (ev,) = wait_for(cancelled_progress, 5, interval_s=0.002, message="the tool saw the abort")
    assert ev.fields["cancelled"] is True
    assert ev.ts - t0 < 0.05, ev.ts - t0
    res = wait_for(lambda: store.result(turn_id, c.id), 5, message="settled")
    assert res.status == "cancelled"


@pytest.mark.parametrize("name", ["raise_on_abort", "aio_raise_on_abort"])
def test_a_tool_that_saw_the_abort_and_raised_settles_cancelled(
    tool_worker, io_worker, name: str
) -> None:
    """The abort wins over the tool's error on both workers: the tool's own settle, with no
    abort step to settle first, gives the status the abort step gives."""
    turn_id = _turn()
    spec = get_tool(name)
    req = ToolTaskRequest(
        turn_id=turn_id,
        call_id=f"c_{name}",
        tool=name,
        arguments={},
        timeout_s=spec.policy.timeout_s,
        soft_timeout_s=None,
        budget_s=1,
    )
    get_app().send_task(spec.task_name, kwargs=req.model_dump(), queue=spec.policy.queue)
    store = get_store()
    wait_for(lambda: req.call_id in store.call_progress(turn_id)[0], 10, message="started")
    store.redis.set(k.turn_key(turn_id, "cancel"), "user")
    store.redis.publish(k.CANCEL_CHANNEL, turn_id)
    res = wait_for(lambda: store.result(turn_id, req.call_id), 10, message="settled")
    assert res.status == "cancelled", res


def test_sync_tool_on_a_thread_and_its_abandoned_timeout(io_worker, turn_worker) -> None:
    fast, slow = call("thread_sleep", seconds=0.2), call("thread_sleep", seconds=3)
    t0 = time.time()
    _turn_id, results = run_round([fast, slow])
    assert [r.status for r in results] == ["ok", "timeout"]
    assert "abandoned" in (results[1].error or "")
    assert time.time() - t0 < 3


def test_sync_def_returning_a_coroutine_is_an_error_not_ok(tool_worker, turn_worker) -> None:
    _turn_id, (res,) = run_round([call("returns_coroutine")])
    assert res.status == "error"
    assert "returned a coroutine" in (res.error or "") and "async def" in (res.error or "")


def test_a_blocking_call_is_named_and_its_neighbours_survive(io_worker, turn_worker) -> None:
    calls = [call("aio_block", seconds=0.6), call("aio_sleep", seconds=0.3)]
    turn_id, results = run_round(calls)
    assert [r.status for r in results] == ["ok", "ok"]
    blocking = [
        e
        for e in get_store().bus.replay(turn_id)
        if e.type == "tool_progress" and e.fields.get("state") == "blocking"
    ]
    assert blocking and blocking[0].fields["call_id"] == calls[0].id
    assert blocking[0].fields["tool"] == "aio_block" and blocking[0].fields["blocked_ms"] >= 100
    assert "blocked" in io_worker.log_text() and calls[0].id in io_worker.log_text()


def test_a_loop_blocked_past_a_hard_limit_recycles_the_worker(local_fleet, turn_worker) -> None:
    proc = local_fleet.start_worker("io", extra_args=("-Q", "agentq.io.recycle"))
    try:
        first = wait_for(proc.children_pids, 10, message="the supervised worker")
        c = call("aio_block_forever", seconds=60)
        t0 = time.time()
        _turn_id, (res,) = run_round([c])
        assert res.status == "timeout" and "recycled" in (res.error or ""), res
        assert time.time() - t0 < 5
        for pid in first:
            wait_for(lambda pid=pid: not psutil.pid_exists(pid), 5, message="old process gone")
        # A fresh worker took its place and runs calls.
        wait_for(lambda: proc.log_text().count(" ready.") >= 2, 30, message="restarted")
        assert proc.is_running()
    finally:
        proc.stop()


def test_a_thousand_concurrent_calls_in_one_worker(io_worker) -> None:
    turn_id = _turn()
    store = get_store()
    # Long enough that a loaded machine's broker hands out half of them before the first
    # ends (the worker takes ~100-300 a second on 2 busy cores).
    n, wait_s = 1000, 8.0
    app = get_app()
    t0 = time.time()
    for i in range(n):
        req = ToolTaskRequest(
            turn_id=turn_id,
            call_id=f"m{i}",
            tool="aio_sleep",
            arguments={"seconds": wait_s},
            timeout_s=30,
            soft_timeout_s=None,
            budget_s=10,
        )
        app.send_task("agentq.tool.aio_sleep", kwargs=req.model_dump(), queue=k.QUEUE_IO)
    wait_for(
        lambda: len(store.results(turn_id)) >= n,
        90,
        interval_s=0.2,
        message="all calls settled",
    )
    took = time.time() - t0
    results = store.results(turn_id).values()
    assert all(r.status == "ok" for r in results)
    pids = {json.loads(r.content)["pid"] for r in results}
    assert len(pids) == 1  # one process
    starts = [r.record.started_at or 0 for r in results]
    ends = [r.record.finished_at or 0 for r in results]
    # They overlapped: far more than one at a time was running on the loop.
    overlap = sum(1 for s in starts if s < min(ends))
    assert overlap >= 500, overlap
    assert took < n * wait_s / 50, took
