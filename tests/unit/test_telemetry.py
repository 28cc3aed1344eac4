"""Traces (with the SDK's in-memory exporter), JSON log lines, step-duration totals and the
event-derived model metrics, in one process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentq.gateway.metrics import GatewayMetrics
from agentq.local.processes import wait_for
from agentq.telemetry import logs, tracing
from agentq.telemetry.fleetcounts import FleetCounts, field_of, read_counts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    assert tracing.setup("test", exporter=exp)
    yield exp
    tracing.shutdown()
    assert not tracing.enabled


@pytest.mark.parametrize(
    ("otel", "env", "on"),
    [
        (None, {}, False),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318"}, True),
        (None, {"OTEL_TRACES_EXPORTER": "console"}, True),
        (None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}, False),
        (None, {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}, False),
        (False, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
        (True, {}, True),
    ],
)
def test_tracing_is_off_unless_configured(otel: bool | None, env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(otel, env) is on


def test_off_costs_nothing_and_records_nothing() -> None:
    assert not tracing.enabled
    tp, _ = tracing.new_turn_trace()
    assert tracing.start_span(tracing.SPAN_STEP, tp, {}) is None
    tracing.end_span(None, "ok")


@pytest.mark.parametrize(
    "bad", [None, "", "00-xyz", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "01-" + "a" * 49]
)
def test_a_bad_traceparent_is_no_parent(bad: object) -> None:
    assert tracing.parse(bad) is None


def test_span_tree_of_one_turn(exporter: InMemorySpanExporter) -> None:
    tp, caller = tracing.new_turn_trace()
    assert caller is None
    ids = tracing.parse(tp)
    assert ids is not None
    attrs = {tracing.ATTR_TURN_ID: "t1"}
    step = tracing.start_span(tracing.SPAN_STEP, tp, attrs)
    tracing.end_span(step, None)
    for call_id, tool in (("c1", "echo"), ("c2", "sleep")):
        call = tracing.start_span(
            tracing.CALL_SPAN_PREFIX + tool,
            tp,
            {**attrs, tracing.ATTR_CALL_ID: call_id, tracing.ATTR_TOOL: tool},
        )
        # A tool's own span nests under its call's span. Through agentq's provider: the
        # global one is set once per process, and an earlier test may have set it.
        tool_tracer = trace.get_tracer("tool", tracer_provider=tracing._provider)
        with tracing.active(call), tool_tracer.start_as_current_span("inside"):
            pass
        tracing.end_span(call, "ok" if tool == "echo" else "timeout")
    rnd = tracing.start_span(tracing.SPAN_ROUND, tp, attrs)
    tracing.end_span(rnd, "ok", {tracing.ATTR_INPUT_TOKENS: 11, tracing.ATTR_OUTPUT_TOKENS: None})
    tracing.end_turn(tp, caller, {**attrs, tracing.ATTR_AGENT: None}, created_at=1.0, status="ok")

    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "inside"}
    assert set(spans) == {
        tracing.SPAN_TURN,
        tracing.SPAN_STEP,
        tracing.SPAN_ROUND,
        "agentq.tool.echo",
        "agentq.tool.sleep",
    }
    root = spans[tracing.SPAN_TURN]
    assert root.context is not None
    assert (root.context.trace_id, root.context.span_id) == ids
    assert root.parent is None and root.start_time == 1_000_000_000
    assert tracing.ATTR_AGENT not in (root.attributes or {})
    for name, span in spans.items():
        assert span.context is not None and span.context.trace_id == ids[0]
        if span is not root:
            assert span.parent is not None and span.parent.span_id == ids[1], name
    assert spans["agentq.tool.sleep"].status.status_code == trace.StatusCode.ERROR
    assert spans["agentq.tool.echo"].status.status_code == trace.StatusCode.UNSET
    assert (spans[tracing.SPAN_ROUND].attributes or {})[tracing.ATTR_INPUT_TOKENS] == 11
    assert tracing.ATTR_OUTPUT_TOKENS not in (spans[tracing.SPAN_ROUND].attributes or {})
    inside = [s for s in exporter.get_finished_spans() if s.name == "inside"]
    assert {s.parent.span_id for s in inside if s.parent} == {
        spans["agentq.tool.echo"].context.span_id,  # type: ignore[union-attr]
        spans["agentq.tool.sleep"].context.span_id,  # type: ignore[union-attr]
    }


def test_a_turn_started_under_a_span_joins_its_trace(exporter: InMemorySpanExporter) -> None:
    outer = TracerProvider().get_tracer("caller")
    with outer.start_as_current_span("request") as request:
        tp, caller = tracing.new_turn_trace()
    ctx = request.get_span_context()
    ids = tracing.parse(tp)
    assert ids is not None and ids[0] == ctx.trace_id and caller is not None
    tracing.end_turn(tp, caller, {}, created_at=None, status="finished")
    (root,) = exporter.get_finished_spans()
    assert root.parent is not None and root.parent.span_id == ctx.span_id


def test_agentq_runs_without_opentelemetry(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from agentq.telemetry import tracing\n"
        "assert not tracing.setup('x', otel=True) and not tracing.enabled\n"
        "tp, caller = tracing.new_turn_trace(); assert tracing.parse(tp) and caller is None\n"
        "import agentq.worker, agentq.gateway.app\n"
        "print('ok')\n"
    )
    env = {**os.environ, "AGENTQ_OTEL": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "pip install 'agentq[otel]'" in out.stderr


def test_json_log_line_carries_the_bound_ids() -> None:
    record = logging.LogRecord("agentq.turn", logging.WARNING, __file__, 1, "x %s", ("y",), None)
    token = logs.bind("turn1", "call1", "task1")
    try:
        line = logs.JsonFormatter().format(record)
    finally:
        logs.unbind(token)
    out = json.loads(line)
    assert out["message"] == "x y" and out["level"] == "WARNING"
    assert (out["turn_id"], out["call_id"], out["task_id"]) == ("turn1", "call1", "task1")
    assert "\n" not in line
    plain = json.loads(logs.JsonFormatter().format(record))
    assert "turn_id" not in plain and "call_id" not in plain


def test_json_log_line_keeps_a_traceback_on_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "agentq", logging.ERROR, __file__, 1, "failed", None, sys.exc_info()
        )
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc"]


def _rendered(counts: dict[str, float]) -> str:
    m = GatewayMetrics()
    m.counts = counts
    return m.render().decode()


def _folded(*events: dict[str, Any]) -> str:
    """/metrics of a fleet whose processes published these events (as published)."""
    fc = FleetCounts()
    r = fakeredis.FakeRedis()
    fc.events([(str(e["type"]), e) for e in events], r, flush_s=3600)
    fc.flush(r)
    return _rendered(read_counts(r))


def test_step_durations_add_up_across_processes() -> None:
    r = fakeredis.FakeRedis()
    a, b = FleetCounts(), FleetCounts()
    a.step(0.002, r, flush_s=3600)
    a.step(0.3, r, flush_s=3600)
    b.step(20.0, r, flush_s=3600)
    assert read_counts(r) == {}  # counted here, not yet in Redis
    a.flush(r)
    b.flush(r)
    counts = read_counts(r)
    text = _rendered(counts)
    step = "agentq_step_duration_seconds"
    assert f'{step}_bucket{{le="0.001"}} 0.0' in text
    assert f'{step}_bucket{{le="0.0025"}} 1.0' in text
    assert f'{step}_bucket{{le="0.5"}} 2.0' in text
    assert f'{step}_bucket{{le="10.0"}} 2.0' in text
    assert f'{step}_bucket{{le="+Inf"}} 3.0' in text
    assert f"{step}_count 3.0" in text and f"{step}_sum 20.302" in text
    a.flush(r)  # nothing new: nothing added
    assert read_counts(r) == counts


def test_the_flusher_thread_adds_counts_by_itself() -> None:
    r = fakeredis.FakeRedis()
    counts = FleetCounts()
    counts.events([("turn_finished", {"reason": "stop"})], r, flush_s=0.05)
    try:
        got = wait_for(lambda: read_counts(r), 5, 0.02, message="the flusher's write")
    finally:
        counts._pid = 0  # its flusher thread ends after its sleep
    assert 'agentq_turns_ended_total{outcome="finished"} 1.0' in _rendered(got)


def test_counts_go_to_the_redis_of_the_newest_count() -> None:
    # A process that moved to another Redis (a test process from fleet to fleet) adds
    # its counts where that Redis's gateways read them, not to the first one it used.
    first, second = fakeredis.FakeRedis(), fakeredis.FakeRedis()
    counts = FleetCounts()
    counts.events([("turn_finished", {"reason": "stop"})], first, flush_s=0.05)
    try:
        wait_for(lambda: read_counts(first), 5, 0.02, message="the first Redis's counts")
        counts.events([("turn_aborted", {"reason": "user"})], second, flush_s=0.05)
        got = wait_for(lambda: read_counts(second), 5, 0.02, message="the second's counts")
    finally:
        counts._pid = 0  # its flusher thread ends after its sleep
    assert 'agentq_turn_aborts_total{reason="user"} 1.0' in _rendered(got)
    assert "agentq_turn_aborts_total{" not in _rendered(read_counts(first))


def test_a_process_that_exits_before_its_first_flush_flushes_at_exit(redis_server: Any) -> None:
    # A CLI that aborts a turn runs the abort step and exits well within a flush interval.
    tool = f"exit_probe_{uuid.uuid4().hex[:8]}"
    code = (
        "import redis\n"
        "from agentq.telemetry.fleetcounts import fleet_counts\n"
        f"r = redis.Redis.from_url({redis_server.url!r})\n"
        f"fleet_counts.events([('tool_finished', {{'tool': {tool!r}, 'status': 'ok'}})], r, 3600)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    got = read_counts(redis.Redis.from_url(redis_server.url))
    assert got.get(field_of("tool_results", (tool, "ok"))) == 1


def test_events_of_other_types_and_unknown_fields_count_nothing() -> None:
    r = fakeredis.FakeRedis()
    counts = FleetCounts()
    # Deltas and progress are never counted, and start no flusher.
    counts.events([("llm_delta", {"text": "x"}), ("tool_progress", {})], r, flush_s=0.05)
    counts.flush(r)
    assert read_counts(r) == {}
    # A hash field of another version (or garbage) is left out of /metrics, not a failure.
    text = _rendered({"no_such|[]|": 3.0, "tool_results|not json|": 1.0, "turns_ended|[]|": 1.0})
    assert "no_such" not in text and "agentq_turns_ended_total 1.0" not in text


def test_gateway_counts_tokens_and_time_to_first_token() -> None:
    event: dict[str, Any] = {
        "type": "llm_finished",
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
        "ttft_ms": 250,
        "duration_ms": 900,
    }
    text = _folded(
        event, {**event, "usage": None, "ttft_ms": None, "error": "x", "code": "ETIMEDOUT"}
    )
    # A worker that predates `model` and `key`: counted under unknown and -.
    assert 'agentq_llm_tokens_total{key="-",kind="prompt",model="unknown"} 11.0' in text
    assert 'agentq_llm_tokens_total{key="-",kind="completion",model="unknown"} 7.0' in text
    assert "agentq_llm_ttft_seconds_count 1.0" in text
    assert 'agentq_llm_ttft_seconds_bucket{le="0.25"} 1.0' in text
    assert 'agentq_llm_round_duration_seconds_count{outcome="error"} 1.0' in text
    assert "agentq_watchdog_trips_total 1.0" in text
    # No step counted: the unlabelled histogram is there, empty.
    assert "agentq_step_duration_seconds_count 0.0" in text


def test_gateway_counts_capacity_waits_busy_answers_and_tokens_by_model() -> None:
    seen: list[dict[str, Any]] = []
    queued: dict[str, Any] = {"type": "llm_queued", "model": "gpt-x", "round_no": 0}
    seen.append({**queued, "position": 3, "wait_s": 1.5, "first": True})
    # The same wait moving up the queue, and a publisher that predates `first`: not counted.
    seen.append({**queued, "position": 2, "wait_s": 1.0, "first": False})
    seen.append({**queued, "position": 1, "wait_s": 0.5})
    seen.append({"type": "llm_started", "model": "gpt-x", "round_no": 0, "queued_ms": 1500})
    seen.append({"type": "llm_started", "model": "gpt-x", "round_no": 1})  # sent at once
    busy = {"type": "llm_finished", "model": "gpt-x", "code": "EBUSY", "error": "busy"}
    seen.append({**busy, "status": 429, "deployment": "east", "duration_ms": 5})
    seen.append({**busy, "status": 529, "deployment": "west", "duration_ms": 5})
    seen.append({**busy, "status": "x", "deployment": "east"})
    usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    seen.append({"type": "llm_finished", "model": "gpt-x", "usage": usage, "duration_ms": 9})
    seen.append({"type": "llm_finished", "model": "gpt-y", "usage": usage, "duration_ms": 9})
    seen.append({"type": "llm_finished", "model": "bad model {", "usage": usage})
    seen.append({"type": "llm_finished", "usage": usage})  # a worker that predates `model`
    text = _folded(*seen)
    assert 'agentq_llm_rounds_queued_total{model="gpt-x"} 1.0' in text
    assert 'agentq_llm_queue_wait_seconds_count{model="gpt-x"} 1.0' in text
    assert 'agentq_llm_queue_wait_seconds_sum{model="gpt-x"} 1.5' in text
    assert 'agentq_llm_queue_wait_seconds_bucket{le="1.0",model="gpt-x"} 0.0' in text
    assert 'agentq_llm_queue_wait_seconds_bucket{le="2.5",model="gpt-x"} 1.0' in text
    busy_total = "agentq_llm_busy_total"
    assert f'{busy_total}{{deployment="east",model="gpt-x",status="429"}} 1.0' in text
    assert f'{busy_total}{{deployment="west",model="gpt-x",status="529"}} 1.0' in text
    assert f'{busy_total}{{deployment="east",model="gpt-x",status="other"}} 1.0' in text
    tokens = "agentq_llm_model_tokens_total"
    assert f'{tokens}{{kind="prompt",model="gpt-x"}} 11.0' in text
    assert f'{tokens}{{kind="completion",model="gpt-y"}} 7.0' in text
    assert f'{tokens}{{kind="prompt",model="other"}} 11.0' in text
    assert f'{tokens}{{kind="prompt",model="unknown"}} 11.0' in text
    # By model and key too; a busy answer has no usage.
    assert 'agentq_llm_tokens_total{key="-",kind="prompt",model="gpt-x"} 11.0' in text
    assert 'agentq_llm_tokens_total{key="-",kind="prompt",model="other"} 11.0' in text
    # No capacity read yet: the gauges have no samples.
    assert "agentq_llm_queued{" not in text and "agentq_llm_paused{" not in text


def test_capacity_gauges_come_from_the_last_snapshots() -> None:
    m = GatewayMetrics()

    def snap(model: str, *, paused_until_ms: int | None, i: int, b: int) -> dict[str, Any]:
        return {
            "model": model,
            "now_ms": 1_000_000,
            "queued": {"interactive": i, "background": b},
            "streams_in_use": i + b,
            "paused_until_ms": paused_until_ms,
        }

    m.snapshots = [
        snap("gpt-x", paused_until_ms=1_005_000, i=2, b=5),
        snap("gpt-y", paused_until_ms=None, i=0, b=0),
    ]
    text = m.render().decode()
    assert 'agentq_llm_queued{class="interactive",model="gpt-x"} 2.0' in text
    assert 'agentq_llm_queued{class="background",model="gpt-x"} 5.0' in text
    assert 'agentq_llm_streams_in_use{model="gpt-x"} 7.0' in text
    assert 'agentq_llm_paused{model="gpt-x"} 1.0' in text
    assert 'agentq_llm_paused{model="gpt-y"} 0.0' in text
    assert 'agentq_llm_queued{class="background",model="gpt-y"} 0.0' in text
    m.snapshots = []  # the read failed: no stale numbers
    assert "agentq_llm_queued{" not in m.render().decode()


def test_gateway_counts_spend_by_model_and_key_and_budget_ends_by_scope() -> None:
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 40, "cost_usd": 0.25}
    finished = {"type": "llm_finished", "model": "gpt-x", "usage": usage, "duration_ms": 9}
    text = _folded(
        {**finished, "key": "ci"},
        {**finished, "key": "ci"},
        {**finished, "key": None},
        {"type": "turn_error", "code": "budget_exceeded", "scope": "key"},
        {"type": "turn_error", "code": "budget_exceeded", "scope": "parent_turn"},
        {"type": "turn_error", "code": "budget_exceeded", "scope": "???"},
        {"type": "turn_error", "code": "ELLM"},
    )
    tokens = "agentq_llm_tokens_total"
    assert f'{tokens}{{key="ci",kind="prompt",model="gpt-x"}} 200.0' in text
    assert f'{tokens}{{key="ci",kind="cached",model="gpt-x"}} 80.0' in text
    assert f'{tokens}{{key="-",kind="completion",model="gpt-x"}} 10.0' in text
    assert 'agentq_llm_cost_usd_total{key="ci",model="gpt-x"} 0.5' in text
    assert 'agentq_llm_cost_usd_total{key="-",model="gpt-x"} 0.25' in text
    assert 'agentq_budget_exceeded_total{scope="key"} 1.0' in text
    assert 'agentq_budget_exceeded_total{scope="parent_turn"} 1.0' in text
    assert 'agentq_budget_exceeded_total{scope="other"} 1.0' in text
