"""Traces, JSON logs and metrics of a real turn, on a fleet of its own with both on.

The fleet uses its own Redis database, so its queues and metrics hold only its turns. Its
workers write their spans to one JSON-lines file (agentq.telemetry.spans), which the test
reads to check the tree across processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.fleet import runtime
from agentq.gateway import create_app
from agentq.local.fleet import LocalFleet
from agentq.local.processes import JSON_READY_PATTERN, ManagedProcess, start_process, wait_for
from agentq.local.redis_server import RedisServer, find_free_port
from agentq.models import Usage
from agentq.telemetry import tracing
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.conftest import base_env

pytestmark = pytest.mark.integration

OBS_DB = 7
FLUSH_S = 0.2
"""The fleet's AGENTQ_METRICS_FLUSH_S."""


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """The spans the workers' exporter (`agentq.telemetry.spans`) wrote to `path` so far."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


USAGE = Usage(prompt_tokens=11, completion_tokens=7, total_tokens=18)


@dataclass
class Obs:
    spans: Path
    logs: dict[str, Path]
    workers: dict[str, ManagedProcess]
    client: Client
    http: httpx.Client


@pytest.fixture(scope="module")
def obs(
    redis_server: RedisServer, llm_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Obs]:
    tmp = tmp_path_factory.mktemp("obs")
    spans = tmp / "spans.jsonl"
    url = re.sub(r"/\d+$", f"/{OBS_DB}", redis_server.url)
    env = base_env(
        url,
        llm_server.url,
        AGENTQ_TOOLS="agentq.testing.tools,agentq.testing.aio_tools",
        AGENTQ_OTEL_SPANS_FILE=str(spans),
        AGENTQ_METRICS_FLUSH_S=str(FLUSH_S),
    )
    # Not for this process: JSON logs would reformat pytest's own handlers.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime.reset()
    logs: dict[str, Path] = {}
    workers: dict[str, ManagedProcess] = {}
    local = LocalFleet({**env, "AGENTQ_LOG_FORMAT": "json"}, log_dir=tmp, name="obs")
    server: BackgroundServer | None = None
    try:
        for kind, concurrency in (("turns", 4), ("llm", 2), ("tools", 2), ("io", None)):
            workers[kind] = local.start_worker(
                kind, concurrency=concurrency, ready_pattern=JSON_READY_PATTERN
            )
            logs[kind] = workers[kind].log_path
        client = Client()
        server = BackgroundServer(create_app(client)).start()
        with httpx.Client(base_url=server.url, timeout=10) as http:
            yield Obs(spans, logs, workers, client, http)
    finally:
        if server is not None:
            server.stop()
        local.stop()
        tracing.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        runtime.reset()


def run_turn(obs: Obs, llm_server: Any) -> tuple[str, dict[str, Any]]:
    """One turn: a round with a sync and an async call, then an answer."""
    key = f"obs-{uuid.uuid4().hex[:10]}"
    calls = [
        ScriptedCall(name="echo", arguments={"text": "hi"}),
        ScriptedCall(name="aio_echo", arguments={"text": "ho"}),
    ]
    llm_server.set_script(
        key,
        [
            Round(text="Calling.", tool_calls=calls, usage=USAGE, chunk_delay_ms=5),
            Round(text="Done.", usage=USAGE),
        ],
    )
    handle = obs.client._start_turn(f"{key} go")
    for ev in obs.client.events(handle.turn_id, heartbeat_s=0.5):
        if ev is not None and ev.type in ("turn_finished", "turn_error", "turn_aborted"):
            assert ev.type == "turn_finished", ev
            break
    return handle.turn_id, obs.client.get(handle.turn_id)


def turn_spans(obs: Obs, turn_id: str) -> list[dict[str, Any]]:
    return [
        s for s in read_spans(obs.spans) if s["attributes"].get(tracing.ATTR_TURN_ID) == turn_id
    ]


def test_one_turn_is_one_trace_across_processes(obs: Obs, llm_server: Any) -> None:
    turn_id, turn = run_turn(obs, llm_server)
    traceparent = turn["state"]["traceparent"]
    ids = tracing.parse(traceparent)
    assert ids is not None, traceparent
    trace_id, turn_span_id = f"{ids[0]:032x}", f"{ids[1]:016x}"

    def complete() -> list[dict[str, Any]] | None:
        spans = turn_spans(obs, turn_id)
        names = [s["name"] for s in spans]
        done = (
            names.count(tracing.SPAN_TURN) == 1
            and names.count(tracing.SPAN_ROUND) == 2
            and "agentq.tool.echo" in names
            and "agentq.tool.aio_echo" in names
        )
        return spans if done else None

    spans = wait_for(complete, 15, 0.1, message="the turn's spans")
    assert isinstance(spans, list)
    assert {s["trace_id"] for s in spans} == {trace_id}
    (root,) = [s for s in spans if s["name"] == tracing.SPAN_TURN]
    assert root["span_id"] == turn_span_id and root["parent_span_id"] is None
    assert root["attributes"][tracing.ATTR_STATUS] == "finished"
    children = [s for s in spans if s is not root]
    assert {s["parent_span_id"] for s in children} == {turn_span_id}
    assert all(root["start_ns"] <= s["start_ns"] for s in children)

    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in children:
        by_name.setdefault(s["name"], []).append(s)
    for r in by_name[tracing.SPAN_ROUND]:
        assert r["attributes"][tracing.ATTR_INPUT_TOKENS] == USAGE.prompt_tokens
        assert r["attributes"][tracing.ATTR_OUTPUT_TOKENS] == USAGE.completion_tokens
        assert r["attributes"][tracing.ATTR_TTFT_MS] >= 0
        assert r["attributes"][tracing.ATTR_STATUS] == "ok"
    call_ids = {m["tool_call_id"]: m for m in turn["history"] if m.get("role") == "tool"}
    for tool in ("echo", "aio_echo"):
        (call,) = by_name[f"agentq.tool.{tool}"]
        attrs = call["attributes"]
        assert attrs[tracing.ATTR_TOOL] == tool and attrs[tracing.ATTR_STATUS] == "ok"
        assert attrs[tracing.ATTR_CALL_ID] in call_ids
        assert call["status"] == "UNSET"
    assert len(by_name[tracing.SPAN_STEP]) >= 2
    # Recorded where the work ran: stream worker, prefork child, I/O worker, steps.
    services = {s["service"] for s in spans}
    assert {"agentq-llm", "agentq-tools", "agentq-io"} <= services, services
    assert len({s["pid"] for s in spans}) >= 3


def test_a_call_the_turn_refuses_has_its_span_too(obs: Obs, llm_server: Any) -> None:
    key = f"obs-{uuid.uuid4().hex[:10]}"
    llm_server.set_script(
        key,
        [Round(tool_calls=[ScriptedCall(name="no_such_tool", arguments={})]), Round(text="ok")],
    )
    handle = obs.client._start_turn(f"{key} go")
    obs.client.wait(handle.turn_id, timeout_s=30)

    def refused() -> dict[str, Any] | None:
        spans = turn_spans(obs, handle.turn_id)
        return next((s for s in spans if s["name"] == "agentq.tool.no_such_tool"), None)

    span = wait_for(refused, 15, 0.1, message="the refused call's span")
    assert isinstance(span, dict)
    assert span["attributes"][tracing.ATTR_STATUS] == "error" and span["status"] == "ERROR"
    assert span["attributes"]["agentq.settled_by"] == "turn"
    ids = tracing.parse(obs.client.get(handle.turn_id)["state"]["traceparent"])
    assert ids is not None and span["parent_span_id"] == f"{ids[1]:016x}"


def test_a_call_killed_at_its_hard_limit_has_one_span(obs: Obs, llm_server: Any) -> None:
    key = f"obs-{uuid.uuid4().hex[:10]}"
    llm_server.set_script(
        key, [Round(tool_calls=[ScriptedCall(name="stuck", arguments={})]), Round(text="ok")]
    )
    handle = obs.client._start_turn(f"{key} go")
    obs.client.wait(handle.turn_id, timeout_s=30)

    def killed() -> list[dict[str, Any]] | None:
        spans = turn_spans(obs, handle.turn_id)
        found = [s for s in spans if s["name"] == "agentq.tool.stuck"]
        return found if any(s["name"] == tracing.SPAN_TURN for s in spans) and found else None

    found = wait_for(killed, 15, 0.1, message="the killed call's span")
    assert isinstance(found, list)
    # The child died with its span open; the worker's parent, which settles the call,
    # records it.
    (span,) = found
    assert span["attributes"][tracing.ATTR_STATUS] == "timeout" and span["status"] == "ERROR"
    assert span["service"] == "agentq-tools"
    assert span["attributes"]["agentq.settled_by"] == "worker"
    assert (span["end_ns"] - span["start_ns"]) / 1e9 >= 1.5


def test_an_aborted_turn_has_its_span_and_one_per_call(obs: Obs, llm_server: Any) -> None:
    key = f"obs-{uuid.uuid4().hex[:10]}"
    calls = [
        ScriptedCall(name="hang", arguments={"seconds": 60}),
        ScriptedCall(name="aio_sleep", arguments={"seconds": 60}),
    ]
    llm_server.set_script(key, [Round(tool_calls=calls), Round(text="never")])
    handle = obs.client._start_turn(f"{key} go")
    started: set[str] = set()
    for ev in obs.client.events(handle.turn_id, heartbeat_s=0.5):
        if ev is not None and ev.type == "tool_started":
            started.add(str(ev.fields["tool"]))
            if started == {"hang", "aio_sleep"}:
                break
    obs.client.abort(handle.turn_id, handle.token)
    obs.client.wait(handle.turn_id, timeout_s=30)

    def spans() -> list[dict[str, Any]] | None:
        got = turn_spans(obs, handle.turn_id)
        names = [s["name"] for s in got]
        done = tracing.SPAN_TURN in names and {"agentq.tool.hang", "agentq.tool.aio_sleep"} <= set(
            names
        )
        return got if done else None

    got = wait_for(spans, 15, 0.1, message="the aborted turn's spans")
    assert isinstance(got, list)
    (root,) = [s for s in got if s["name"] == tracing.SPAN_TURN]
    assert root["attributes"][tracing.ATTR_STATUS] == "aborted" and root["status"] == "ERROR"
    for tool in ("hang", "aio_sleep"):
        (call,) = [s for s in got if s["name"] == f"agentq.tool.{tool}"]
        assert call["attributes"][tracing.ATTR_STATUS] == "cancelled", call
        assert call["parent_span_id"] == root["span_id"]


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_json_log_line_per_step(obs: Obs, llm_server: Any) -> None:
    turn_id, _ = run_turn(obs, llm_server)

    def step_spans() -> list[dict[str, Any]] | None:
        spans = turn_spans(obs, turn_id)
        steps = [s for s in spans if s["name"] == tracing.SPAN_STEP]
        return steps if any(s["name"] == tracing.SPAN_TURN for s in spans) else None

    steps = wait_for(step_spans, 15, 0.1, message="the turn's step spans")
    assert isinstance(steps, list)
    # Steps run as Celery tasks on a turn worker; the rest inline where a result landed
    # (no task).
    task_of = {"agentq-turns": ("turns", "agentq.turn.step")}
    task_steps = {
        (s["service"], s["attributes"][tracing.ATTR_TASK_ID])
        for s in steps
        if s["service"] in task_of and s["attributes"].get(tracing.ATTR_TASK_ID)
    }
    assert "agentq-turns" in {svc for svc, _ in task_steps}, steps

    def logged() -> bool:
        for svc, task_id in task_steps:
            kind, name = task_of[svc]
            lines = json_lines(obs.logs[kind])
            if not any(
                x.get("turn_id") == turn_id
                and x.get("task_name") == name
                and x.get("task_id") == task_id
                for x in lines
            ):
                return False
        return True

    # Each step a worker ran as a task has its own JSON line (Celery's "succeeded"),
    # carrying the turn and the Celery task.
    assert wait_for(logged, 10, 0.1, message="a JSON line per step")
    lines = json_lines(obs.logs["llm"])
    mine = [x for x in lines if x.get("turn_id") == turn_id]
    assert all({"ts", "level", "logger", "message", "pid"} <= x.keys() for x in mine)
    assert any("succeeded" in x["message"] for x in mine)
    # Celery's `received` line, which carries no turn, is off (AGENTQ_TASK_RECEIVED_LOGS).
    assert not any(
        x.get("logger") == "celery.worker.strategy" and x.get("level") == "INFO"
        for kind in ("turns", "tools", "llm", "io")
        for x in json_lines(obs.logs[kind])
    )
    # After the banner every line of a worker's log is one JSON object.
    for kind in ("turns", "llm", "tools", "io"):
        text = obs.logs[kind].read_text().splitlines()
        ready = next(i for i, t in enumerate(text) if re.search(JSON_READY_PATTERN, t))
        for t in text[ready:]:
            assert isinstance(json.loads(t), dict), (kind, t)

    # Calls log with their call id: Celery's line about the prefork task carries it. The
    # worker writes it when the pool hands the task's return back, which can come after
    # the turn ended (the call's own process took the turn's last step).
    def call_logged() -> bool:
        lines = [x for x in json_lines(obs.logs["tools"]) if x.get("turn_id") == turn_id]
        return any(x.get("call_id") and x.get("task_id") for x in lines)

    assert wait_for(call_logged, 10, 0.1, message="the call's JSON line with its call id")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def settled_metrics(obs: Obs) -> str:
    """/metrics once the fleet's counts stopped moving (each process adds what it counted
    every FLUSH_S: an earlier test's last events may still be on their way)."""
    seen: list[str] = []

    def still() -> str | None:
        text = re.sub(
            r"^agentq_(sse|events_streamed|active|running).*$",
            "",
            obs.http.get("/metrics").text,
            flags=re.M,
        )
        seen.append(text)
        return text if len(seen) > 1 and seen[-2] == text else None

    return wait_for(still, 10, 3 * FLUSH_S, message="the fleet's counts to settle")


def test_metrics_of_real_turns(obs: Obs, llm_server: Any) -> None:
    before = settled_metrics(obs)
    # Turns started without a key, of the client's model.
    of = f'key="-",kind="{{}}",model="{obs.client.settings.llm_model}"'
    prompt_tokens = "agentq_llm_tokens_total{" + of.format("prompt") + "}"
    completion_tokens = "agentq_llm_tokens_total{" + of.format("completion") + "}"
    turn_id, _ = run_turn(obs, llm_server)
    spans = wait_for(
        lambda: (
            (s := turn_spans(obs, turn_id)) and any(x["name"] == tracing.SPAN_TURN for x in s) and s
        ),
        15,
        0.1,
    )
    assert isinstance(spans, list)
    steps = len([s for s in spans if s["name"] == tracing.SPAN_STEP])
    base = {
        name: metric(before, name)
        for name in (
            prompt_tokens,
            completion_tokens,
            "agentq_llm_ttft_seconds_count",
            "agentq_step_duration_seconds_count",
        )
    }

    def scraped() -> str | None:
        text = obs.http.get("/metrics").text
        grew = (
            metric(text, prompt_tokens) >= base[prompt_tokens] + 2 * USAGE.prompt_tokens
            and metric(text, "agentq_step_duration_seconds_count")
            >= base["agentq_step_duration_seconds_count"] + steps
        )
        return text if grew else None

    text = wait_for(scraped, 10, 0.1, message="token and step metrics")
    assert isinstance(text, str)
    assert metric(text, completion_tokens) >= base[completion_tokens] + 2 * USAGE.completion_tokens
    assert metric(text, "agentq_llm_ttft_seconds_count") >= (
        base["agentq_llm_ttft_seconds_count"] + 2
    )
    assert metric(text, 'agentq_llm_round_duration_seconds_count{outcome="ok"}') >= 2
    for tool in ("echo", "aio_echo"):
        name = f'agentq_tool_duration_seconds_count{{status="ok",tool="{tool}"}}'
        assert metric(text, name) >= 1, name
    assert metric(text, 'agentq_step_duration_seconds_bucket{le="+Inf"}') == metric(
        text, "agentq_step_duration_seconds_count"
    )
    assert metric(text, "agentq_step_duration_seconds_sum") > 0


def test_capacity_metrics_of_a_round_the_provider_refused_once(obs: Obs, llm_server: Any) -> None:
    # A 429 pauses the model fleet-wide for its Retry-After: the round waits for capacity,
    # then goes out again and finishes.
    model = obs.client.settings.llm_model
    names = {
        "queued": f'agentq_llm_rounds_queued_total{{model="{model}"}}',
        "waits": f'agentq_llm_queue_wait_seconds_count{{model="{model}"}}',
        "waited_s": f'agentq_llm_queue_wait_seconds_sum{{model="{model}"}}',
        "busy": f'agentq_llm_busy_total{{deployment="default",model="{model}",status="429"}}',
        "prompt": f'agentq_llm_model_tokens_total{{kind="prompt",model="{model}"}}',
        "completion": f'agentq_llm_model_tokens_total{{kind="completion",model="{model}"}}',
    }
    before = settled_metrics(obs)
    base = {k: metric(before, name) for k, name in names.items()}
    key = f"obs-{uuid.uuid4().hex[:10]}"
    busy_once = Round(text="Done.", usage=USAGE, fault="http_429", fault_times=1, retry_after_s=2.5)
    llm_server.set_script(key, [busy_once])
    handle = obs.client._start_turn(f"{key} go")
    events = []
    for ev in obs.client.events(handle.turn_id, heartbeat_s=0.5):
        if ev is None:
            continue
        events.append(ev)
        if ev.type in ("turn_finished", "turn_error", "turn_aborted"):
            break
    assert events[-1].type == "turn_finished", events[-1]
    finished = [e.fields for e in events if e.type == "llm_finished"]
    assert [f.get("code") for f in finished] == ["EBUSY", None]
    assert finished[0]["status"] == 429 and finished[1]["model"] == model
    queued = [e.fields for e in events if e.type == "llm_queued"]
    assert queued and queued[0]["first"] is True
    assert not any(f["first"] for f in queued[1:])
    # The first send did not wait; the second waited for the pause to end.
    waits = [e.fields.get("queued_ms") for e in events if e.type == "llm_started"]
    assert len(waits) == 2 and waits[0] is None
    queued_ms = waits[1]
    assert isinstance(queued_ms, int) and queued_ms > 0

    def scraped() -> str | None:
        text = obs.http.get("/metrics").text
        grew = (
            metric(text, names["queued"]) == base["queued"] + 1
            and metric(text, names["waits"]) == base["waits"] + 1
            and metric(text, names["busy"]) == base["busy"] + 1
            and metric(text, names["prompt"]) == base["prompt"] + USAGE.prompt_tokens
        )
        return text if grew else None

    text = wait_for(scraped, 10, 0.1, message="the capacity metrics")
    assert isinstance(text, str)
    assert metric(text, names["completion"]) == base["completion"] + USAGE.completion_tokens
    assert metric(text, names["waited_s"]) - base["waited_s"] == pytest.approx(
        queued_ms / 1000, abs=0.01
    )
    # The capacity gauges of the model the fleet uses, read at scrape time.
    for gauge in ("agentq_llm_paused", "agentq_llm_streams_in_use"):
        assert re.search(rf'^{gauge}\{{model="{re.escape(model)}"\}} \S+$', text, re.M), gauge
    assert f'agentq_llm_queued{{class="interactive",model="{model}"}}' in text


def test_gateway_logs_json_without_the_token(obs: Obs, tmp_path: Path) -> None:
    port = find_free_port()
    env = {**os.environ, "AGENTQ_LOG_FORMAT": "json", "AGENTQ_GATEWAY_PORT": str(port)}
    log_path = tmp_path / "gateway.log"
    with start_process(
        [sys.executable, "-m", "agentq", "serve"],
        env=env,
        log_path=log_path,
        ready_pattern=r'"message": "Uvicorn running',
        name="gateway-json",
    ):
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/turns/nope/events?token=s3cr3t-t0ken").status_code == 404

        def access() -> dict[str, Any] | None:
            lines = json_lines(log_path)
            return next((x for x in lines if x["logger"] == "uvicorn.access"), None)

        line = wait_for(access, 10, 0.05, message="the access log line")
        assert isinstance(line, dict) and "/v1/turns/nope/events" in line["message"]
    text = log_path.read_text()
    assert "s3cr3t-t0ken" not in text
    assert all(isinstance(json.loads(t), dict) for t in text.splitlines() if t.strip())


def test_a_worker_that_settles_a_call_takes_the_next_step_itself(obs: Obs, llm_server: Any) -> None:
    turn_id, _ = run_turn(obs, llm_server)

    def services() -> set[str] | None:
        spans = turn_spans(obs, turn_id)
        if not any(s["name"] == tracing.SPAN_TURN for s in spans):
            return None
        return {s["service"] for s in spans if s["name"] == tracing.SPAN_STEP}

    stepped = wait_for(services, 15, 0.1, message="the turn's step spans")
    # Inline steps (steps.step_inline): the tool and I/O workers' children settle the
    # round's calls, the model worker its rounds.
    assert isinstance(stepped, set) and stepped - {"agentq-turns"}, stepped
