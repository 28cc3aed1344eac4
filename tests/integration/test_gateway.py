"""The HTTP gateway over a real uvicorn server, real workers and the scripted model."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentq.api import Client
from agentq.config import get_settings
from agentq.constants import turn_key
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.state.store import TurnStore
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from agentq.testing.sse import SSEMessage, iter_sse
from tests.helpers import calls, follow_until, script

pytestmark = pytest.mark.integration

TERMINAL = ("turn_finished", "turn_aborted", "turn_error")
STREAM_ID = re.compile(r"^\d+-\d+$")


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client())) as server:
        yield server


@pytest.fixture()
def http(gateway: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(30.0)) as c:
        yield c


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def start(http: httpx.Client, prompt: str, **fields: Any) -> dict[str, Any]:
    r = http.post("/v1/turns", json={"prompt": prompt, **fields})
    assert r.status_code == 202, r.text
    body: dict[str, Any] = r.json()
    assert set(body) == {"turn_id", "token", "events_url"}
    return body


def read(
    http: httpx.Client,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    until: Callable[[SSEMessage], bool] | None = None,
) -> list[SSEMessage]:
    """Event messages of one SSE response: to its end, or up to the first `until` match."""
    out: list[SSEMessage] = []
    with http.stream("GET", url, headers=headers, params=params) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for msg in iter_sse(resp):
            if msg.comment is not None or msg.id is None:
                continue
            out.append(msg)
            if until is not None and until(msg):
                return out
    return out


def is_type(*types: str, tool: str | None = None) -> Callable[[SSEMessage], bool]:
    def match(msg: SSEMessage) -> bool:
        return msg.event in types and (tool is None or msg.json().get("tool") == tool)

    return match


def sse_connections(http: httpx.Client) -> float:
    m = re.search(r"^agentq_sse_connections (\S+)$", http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else -1.0


def test_turn_streams_every_event_with_its_stream_id(
    fleet, llm_server, http, client: Client
) -> None:
    key = script(
        llm_server,
        Round(text="Checking.", tool_calls=calls(("echo", {"text": "hi"}))),
        Round(text="All done."),
    )
    h = start(http, key)
    assert h["events_url"] == f"/v1/turns/{h['turn_id']}/events"
    msgs = read(http, h["events_url"], headers=auth(h["token"]))
    data = [m.json() for m in msgs]
    assert [d["type"] for d in data] == [m.event for m in msgs]
    assert all(STREAM_ID.match(m.id or "") for m in msgs)
    assert [m.id for m in msgs] == [d["stream_id"] for d in data]
    assert [d["seq"] for d in data] == list(range(1, len(data) + 1))
    assert data[0]["type"] == "turn_started" and data[-1]["type"] == "turn_finished"
    assert "llm_delta" in [d["type"] for d in data] and data[-1]["content"] == "All done."
    assert [e.stream_id for e in client._store.bus.replay(h["turn_id"])] == [m.id for m in msgs]

    turn = http.get(f"/v1/turns/{h['turn_id']}")
    # Neither the turn's token nor its hash (token counts of its spend are fine).
    assert turn.status_code == 200 and h["token"] not in turn.text
    assert "token_sha256" not in turn.text
    body = turn.json()
    assert body["state"]["status"] == "finished"
    assert [r["status"] for r in body["invocations"]] == ["ok"]
    assert [m["role"] for m in body["history"]] == ["user", "assistant", "tool", "assistant"]
    # A reconnect after the terminal event gets 204, which stops EventSource retrying ...
    again = http.get(h["events_url"], headers={"Last-Event-ID": msgs[-1].id or ""})
    assert again.status_code == 204
    # ... while a late reader from the start gets the whole log and the stream ends.
    assert [m.id for m in read(http, h["events_url"])] == [m.id for m in msgs]


def test_reconnect_with_last_event_id_gets_exactly_the_rest(
    fleet, llm_server, http, client: Client
) -> None:
    key = script(
        llm_server,
        Round(text="One moment.", tool_calls=calls(("sleep", {"seconds": 1.5}))),
        Round(text="Slept well.", chunk_delay_ms=10),
    )
    h = start(http, key, detach=True)
    first = read(http, h["events_url"], until=is_type("tool_started"))
    assert first[-1].event == "tool_started"
    rest = read(http, h["events_url"], headers={"Last-Event-ID": first[-1].id or ""})
    seqs = [m.json()["seq"] for m in first + rest]
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # no gap, no duplicate
    assert rest[-1].event == "turn_finished"
    assert "tool_progress" in [m.event for m in rest]
    log_ids = [e.stream_id for e in client._store.bus.replay(h["turn_id"])]
    assert [m.id for m in first + rest] == log_ids
    # EventSource cannot set headers on a fresh connection: ?after= does the same.
    cut = len(first) // 2
    tail = read(http, h["events_url"], params={"after": first[cut - 1].id or ""})
    assert [m.id for m in tail] == log_ids[cut:]


def test_abort_over_http_then_404(fleet, llm_server, http, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    h = start(http, key, detach=True)
    url = f"/v1/turns/{h['turn_id']}/abort"
    with http.stream("GET", h["events_url"]) as resp:
        events = iter_sse(resp)
        next(m for m in events if m.event == "tool_started")
        r = http.post(url, headers=auth(h["token"]))
        assert r.status_code == 200 and r.json() == {"ok": True, "turn_id": h["turn_id"]}
        aborted = next(m for m in events if m.event == "turn_aborted").json()
    assert aborted["reason"] == "user"
    again = http.post(url, headers=auth(h["token"]))
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "TurnNotFound"
    turn = http.get(f"/v1/turns/{h['turn_id']}").json()
    assert turn["state"]["status"] == "aborted"
    assert [r["status"] for r in turn["invocations"]] == ["cancelled"]


def test_errors_are_json_with_the_right_status(fleet, llm_server, http, client: Client) -> None:
    for method, path in [
        ("GET", "/v1/turns/nope"),
        ("GET", "/v1/turns/nope/events"),
        ("POST", "/v1/turns/nope/abort"),
    ]:
        r = http.request(method, path, headers=auth("whatever"))
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "TurnNotFound"
    assert http.get("/no/such/page").json()["error"]["type"] == "NotFound"
    assert http.delete("/v1/turns").status_code == 405

    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    h = start(http, key, detach=True)
    abort_url = f"/v1/turns/{h['turn_id']}/abort"
    missing = http.post(abort_url)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "Unauthorized"
    wrong = http.post(abort_url, headers=auth("not-the-token"))
    assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "TokenInvalid"
    assert http.get(h["events_url"], params={"token": "not-the-token"}).status_code == 403
    bad_id = http.get(h["events_url"], headers={"Last-Event-ID": "yesterday"})
    assert bad_id.status_code == 422 and "Last-Event-ID" in bad_id.json()["error"]["message"]
    assert http.post(abort_url, headers=auth(h["token"])).status_code == 200

    malformed = http.post(
        "/v1/turns", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert malformed.status_code == 422
    assert malformed.json()["error"]["type"] == "MalformedJSON"
    for body, field in [
        ([1, 2], "body"),
        ({"prompt": "x", "headless": "maybe"}, "headless"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({}, "prompt"),
        ({"prompt": "x", "parent_turn_id": h["turn_id"]}, "parent_turn_id"),
    ]:
        r = http.post("/v1/turns", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["message"].startswith(f"{field}:"), r.json()

    limit = get_settings().max_prompt_bytes
    too_long = http.post("/v1/turns", json={"prompt": "x" * (limit + 1)})
    assert too_long.status_code == 413
    assert too_long.json()["error"]["type"] == "PayloadTooLarge"
    huge = http.post("/v1/turns", json={"prompt": "x" * (2 * limit)})
    assert huge.status_code == 413
    assert "request body" in huge.json()["error"]["message"]


def test_interaction_answer_paths(fleet, llm_server, http, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))),
        Round(text="Deleted."),
    )
    h = start(http, key, detach=True)
    with http.stream("GET", h["events_url"]) as resp:
        events = iter_sse(resp)
        req = next(m for m in events if m.event == "interaction_requested").json()
        assert req["kind"] == "approval" and req["timeout_ms"] > 0
        base = f"/v1/turns/{h['turn_id']}/interactions"
        url = f"{base}/{req['request_id']}"
        unknown = http.post(f"{base}/nope", json={"decision": "approve"}, headers=auth(h["token"]))
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "InteractionNotFound"
        assert http.post(url, json={"decision": "approve"}).status_code == 401
        assert (
            http.post(url, json={"decision": "maybe"}, headers=auth(h["token"])).status_code == 422
        )
        ok = http.post(url, json={"decision": "approve"}, headers=auth(h["token"]))
        assert ok.status_code == 200 and ok.json()["ok"] is True
        twice = http.post(url, json={"decision": "deny"}, headers=auth(h["token"]))
        assert twice.status_code == 409
        assert twice.json()["error"]["type"] == "InteractionClosed"
        rest = [m for m in events if m.id is not None]
    types = [m.event for m in rest]
    assert "interaction_answered" in types and types[-1] == "turn_finished"
    finished = [m.json() for m in rest if m.event == "tool_finished"]
    assert [(f["tool"], f["status"]) for f in finished] == [("delete_file", "ok")]


def test_disconnect_aborts_an_attached_turn(fleet, llm_server, http, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    h = start(http, key)
    with http.stream("GET", h["events_url"], params={"token": h["token"]}) as resp:
        next(m for m in iter_sse(resp) if m.event == "tool_started")
        # A stream parked in the follow loop must not hold up the event loop.
        t0 = time.monotonic()
        assert http.get("/healthz").status_code == 200
        assert time.monotonic() - t0 < 2.0
    closed = time.monotonic()
    ev = follow_until(client, h["turn_id"], *TERMINAL)
    took_s = time.monotonic() - closed
    assert ev.type == "turn_aborted" and ev.fields["reason"] == "disconnect", ev
    assert took_s < 5.0, took_s
    assert client.get(h["turn_id"])["invocations"][0]["status"] == "cancelled"


def test_disconnect_leaves_a_detached_turn_running(fleet, llm_server, http, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    h = start(http, key, detach=True)
    with http.stream(
        "GET", h["events_url"], headers=auth(h["token"]), params={"heartbeat": "0.2"}
    ) as resp:
        events = iter_sse(resp)
        next(m for m in events if m.event == "tool_started")
        beat = next(m for m in events if m.comment is not None)
        assert beat.comment == "keep-alive"
        followers = partial(client._store.redis.hget, turn_key(h["turn_id"]), "watchers")
        assert followers() == b"1"
    # The gateway counts a stream closed only after it has handled the disconnect.
    wait_for(lambda: sse_connections(http) == 0, 10, 0.1, message="the stream was not closed")
    # The server-side follow loop stopped too: it counted itself out of the turn.
    wait_for(lambda: followers() is None, 10, 0.1, message="the follow loop still follows the turn")
    turn = http.get(f"/v1/turns/{h['turn_id']}").json()
    assert turn["state"]["status"] == "running"
    assert "turn_aborted" not in [e.type for e in client._store.bus.replay(h["turn_id"])]
    assert http.post(f"/v1/turns/{h['turn_id']}/abort", headers=auth(h["token"])).status_code == 200
    assert follow_until(client, h["turn_id"], *TERMINAL).fields["reason"] == "user"


def test_active_healthz_and_metrics(fleet, llm_server, http, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    h = start(http, key, detach=True)
    follow_until(client, h["turn_id"], "tool_started")
    active = http.get("/v1/turns/active").json()["turns"]
    mine = next(t for t in active if t["turn_id"] == h["turn_id"])
    assert [c["tool"] for c in mine["current_tools"]] == ["hang"]
    assert mine["status"] == "running" and mine["call_count"] == 1
    text = http.get("/metrics").text
    assert re.search(r'^agentq_active_turns\{status="running"\} [1-9]', text, re.M), text
    assert re.search(r"^agentq_running_tool_calls [1-9]", text, re.M)
    http.post(f"/v1/turns/{h['turn_id']}/abort", headers=auth(h["token"]))

    health = http.get("/healthz")
    assert health.status_code == 200 and health.json()["ok"] is True
    quick = script(llm_server, Round(tool_calls=calls(("echo", {"text": "m"}))), Round(text="k"))
    q = start(http, quick)
    read(http, q["events_url"])

    def scraped() -> str | None:
        body = http.get("/metrics")
        ok = (
            'agentq_tool_duration_seconds_bucket{le="0.05",status="ok",tool="echo"}' in body.text
            and 'agentq_turn_aborts_total{reason="user"}' in body.text
        )
        return body.text if ok else None

    # Each worker adds what it counted to the fleet's every AGENTQ_METRICS_FLUSH_S (5 s):
    # a loaded machine's flush may come late.
    text = wait_for(scraped, 30, 0.1, message="tool and abort metrics")
    assert isinstance(text, str)
    for name in (
        "agentq_tool_results_total",
        "agentq_tool_timeouts_total",
        "agentq_watchdog_trips_total",
        "agentq_turns_ended_total",
        'agentq_events_streamed_total{type="turn_finished"}',
        "agentq_redis_up 1.0",
    ):
        assert name in text, name


def test_healthz_is_503_when_redis_is_down(agentq_env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    # A real Client whose Redis is a closed port: the gateway must answer, not hang.
    dead = Client.__new__(Client)
    dead.settings = get_settings()
    dead._app = None
    dead._store = TurnStore(
        redis.Redis(
            host="127.0.0.1", port=dead_port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )
    )
    with (
        BackgroundServer(create_app(dead)) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        r = http.get("/healthz")
        assert r.status_code == 503 and r.json()["error"]["type"] == "RedisUnavailable"
        assert "agentq_redis_up 0.0" in http.get("/metrics").text
        down = http.get("/v1/turns/" + "0" * 32)
        assert down.status_code == 503 and down.json()["error"]["type"] == "RedisUnavailable"


def test_gateway_shutdown_ends_streams_cleanly_and_leaves_turns_running(
    fleet, llm_server, client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    server = BackgroundServer(create_app(Client())).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            h = start(http, key)
            with http.stream("GET", h["events_url"], params={"token": h["token"]}) as resp:
                events = iter_sse(resp)
                next(m for m in events if m.event == "tool_started")
                t0 = time.monotonic()
                server.stop()
                stopped_s = time.monotonic() - t0
                # The stream ends without a terminal event and without a protocol error:
                # EventSource would reconnect with its last id.
                assert {m.event for m in events if m.id is not None} <= {"tool_progress"}
    finally:
        server.stop()
    assert stopped_s < 3.0, stopped_s
    # The owner did not leave: the server did. The attached turn runs on.
    assert client.get(h["turn_id"])["state"]["status"] == "running"
    client.abort(h["turn_id"], h["token"])
    assert follow_until(client, h["turn_id"], *TERMINAL).fields["reason"] == "user"


def test_access_log_never_shows_a_token() -> None:
    import logging

    from agentq.telemetry.redact import redact_record

    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/v1/turns/t/events?token=s3cr3t&heartbeat=1", "1.1", 200),
        None,
    )
    redact_record(record)
    assert "s3cr3t" not in record.getMessage() and "heartbeat=1" in record.getMessage()
