"""Hostile input to the gateway (issue 17): ids, Last-Event-ID, bodies, messages, log lines.

Each test failed before its fix: a hang, a 500/503, or a 202 that failed later.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agentq.api import Client
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.local.redis_server import find_free_port
from agentq.models import TurnRequest
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from agentq.testing.sse import iter_sse
from tests.helpers import script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FUTURE_ID = "9999999999999-0"
TERMINAL = ("turn_finished", "turn_aborted", "turn_error")


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client(), heartbeat_s=0.2, poll_s=0.2)) as server:
        yield server


@pytest.fixture()
def http(gateway: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(20.0)) as c:
        yield c


def hanging_turn(http: httpx.Client, llm_server: Any) -> dict[str, Any]:
    key = script(
        llm_server, Round(tool_calls=[ScriptedCall(name="hang", arguments={"seconds": 60})])
    )
    r = http.post("/v1/turns", json={"prompt": key, "detach": True})
    assert r.status_code == 202, r.text
    return dict(r.json())


def error_of(r: httpx.Response, status: int) -> dict[str, str]:
    assert r.status_code == status, (r.status_code, r.text)
    err: dict[str, str] = r.json()["error"]
    assert err["type"] and err["message"]
    return err


# -- 1. Last-Event-ID ------------------------------------------------------------------


def test_a_future_last_event_id_waits_for_real_events_and_ends_with_the_turn(
    http: httpx.Client, llm_server: Any, client: Client
) -> None:
    h = hanging_turn(http, llm_server)
    wait_for(
        lambda: "tool_started" in [e.type for e in client._store.bus.replay(h["turn_id"])],
        timeout_s=15,
    )
    got: list[str] = []
    done = threading.Event()

    def read() -> None:
        with http.stream("GET", h["events_url"], headers={"Last-Event-ID": FUTURE_ID}) as resp:
            assert resp.status_code == 200
            for msg in iter_sse(resp):
                if msg.id is not None:
                    got.append(str(msg.event))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert not done.wait(0.5), "the stream ended before the turn did"
    r = http.post(
        f"/v1/turns/{h['turn_id']}/abort", headers={"Authorization": f"Bearer {h['token']}"}
    )
    assert r.status_code == 200, r.text
    assert done.wait(15), f"the stream did not end with the turn; got {got}"
    assert got and got[-1] == "turn_aborted", got
    assert "turn_started" not in got and "tool_started" not in got, got

    # The turn ended: an id past its log's end ends at once, with 204.
    assert http.get(h["events_url"], headers={"Last-Event-ID": FUTURE_ID}).status_code == 204


@pytest.mark.parametrize(
    "value",
    [
        "99999999999999999999999-0",
        "18446744073709551616-0",
        "1-18446744073709551616",
        "1-0-0",
        "-1",
    ],
)
def test_an_out_of_range_last_event_id_is_422(
    http: httpx.Client, llm_server: Any, value: str
) -> None:
    h = hanging_turn(http, llm_server)
    try:
        err = error_of(http.get(h["events_url"], headers={"Last-Event-ID": value}), 422)
        assert "Last-Event-ID" in err["message"] and "64-bit" in err["message"]
        err = error_of(http.get(h["events_url"], params={"after": value}), 422)
    finally:
        auth = {"Authorization": f"Bearer {h['token']}"}
        aborted = http.post(f"/v1/turns/{h['turn_id']}/abort", headers=auth)
    assert aborted.status_code == 200, aborted.text
    # Ended first (a stream after a future id on a running turn waits for the turn's end).
    wait_for(
        lambda: (
            http.get(f"/v1/turns/{h['turn_id']}", headers=auth).json()["state"]["status"]
            == "aborted"
        ),
        timeout_s=30,
        message="the turn ended",
    )
    # The largest id Redis accepts is still an id: no Redis error, just the ended turn's 204.
    top = "18446744073709551615-18446744073709551615"
    assert http.get(h["events_url"], headers={"Last-Event-ID": top}).status_code == 204


# -- 2. ids in paths -----------------------------------------------------------------------


def test_turn_and_request_ids_are_checked_before_any_redis_key(
    http: httpx.Client, llm_server: Any
) -> None:
    h = hanging_turn(http, llm_server)
    tid, auth = h["turn_id"], {"Authorization": f"Bearer {h['token']}"}
    try:
        for suffix in (":results", ":log", ":history", ":plan"):
            for path in (f"/v1/turns/{tid}{suffix}", f"/v1/turns/{tid}{suffix}/events"):
                err = error_of(http.get(path, headers=auth), 404)
                assert err["type"] == "TurnNotFound" and "32 lowercase hex" in err["message"]
            err = error_of(http.post(f"/v1/turns/{tid}{suffix}/abort", headers=auth), 404)
        bad_turn = f"/v1/turns/{tid}:interaction/interactions/call_r0_0.approval"
        error_of(http.post(bad_turn, json={"decision": "approve"}, headers=auth), 404)
        assert error_of(http.get(f"/v1/turns/{tid.upper()}"), 404)["type"] == "TurnNotFound"
        for rid in (
            "call_r0_0",
            "a b.approval",
            "x" * 200 + ".approval",
            "%00.approval",
            ".approval",
        ):
            r = http.post(
                f"/v1/turns/{tid}/interactions/{rid}", json={"decision": "approve"}, headers=auth
            )
            err = error_of(r, 404)
            assert err["type"] == "InteractionNotFound" and "call id" in err["message"], rid
        # A well-formed request id that names nothing is still a plain 404.
        r = http.post(
            f"/v1/turns/{tid}/interactions/call_zz.approval",
            json={"decision": "approve"},
            headers=auth,
        )
        assert error_of(r, 404)["type"] == "InteractionNotFound"
        assert http.get(f"/v1/turns/{tid}").status_code == 200
    finally:
        http.post(f"/v1/turns/{tid}/abort", headers=auth)


# -- 3. bodies -------------------------------------------------------------------------------


def test_deep_nesting_and_lone_surrogates_are_422(http: httpx.Client) -> None:
    deep = b'{"prompt": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = error_of(
        http.post("/v1/turns", content=deep, headers={"Content-Type": "application/json"}), 422
    )
    assert "nested deeper" in err["message"]
    for raw in (
        b'{"prompt": "a\\ud800c"}',
        b'{"prompt": "ok", "messages": [{"role": "user", "content": "\\udfff"}]}',
        b'{"prompt": "a", "conversation_token": "\\ud83d"}',
        b'{"prompt": NaN}',
    ):
        r = http.post("/v1/turns", content=raw, headers={"Content-Type": "application/json"})
        err = error_of(r, 422)
        assert err["type"] == "MalformedJSON", raw
    # A proper pair is one character, not a lone surrogate.
    ok = http.post(
        "/v1/turns",
        content=b'{"prompt": "\\ud83d\\ude00", "detach": true}',
        headers={"Content-Type": "application/json"},
    )
    assert ok.status_code == 202, ok.text
    assert http.get(f"/v1/turns/{ok.json()['turn_id']}").status_code == 200


CALL = {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}
BAD_MESSAGES = [
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "evil"}]}], "tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"id": "evil"}]}], "tool_calls.0"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "echo"}}]}], "arguments"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}], "type"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "id": "a b"}]}], "tool_calls.0.id"),
    ([{"role": "tool", "tool_call_id": "c1", "content": "r"}], "answers no open call"),
    ([{"role": "assistant", "tool_calls": [CALL]}], "no tool message"),
    (
        [{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "x"}],
        "no tool message",
    ),
    (
        [
            {"role": "assistant", "tool_calls": [CALL, CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ],
        "used twice",
    ),
    ([{"role": "user", "content": [{"type": "video", "url": "x"}]}], "content"),
    ([{"role": "system", "content": "s", "extra": 1}], "extra"),
]


@pytest.mark.parametrize(("messages", "phrase"), BAD_MESSAGES)
def test_invalid_messages_are_refused_up_front(
    http: httpx.Client, client: Client, messages: list[dict[str, Any]], phrase: str
) -> None:
    err = error_of(http.post("/v1/turns", json={"messages": messages}), 422)
    assert err["message"].startswith("messages:") and phrase in err["message"], err
    with pytest.raises(ValidationError, match=phrase):
        client._start_turn(messages=messages)
    # A request built without validation is checked again by Client.start.
    with pytest.raises(ValueError, match=phrase):
        client._start_turn(TurnRequest.model_construct(messages=messages, prompt=None))


def test_a_valid_chat_history_runs(http: httpx.Client, llm_server: Any, client: Client) -> None:
    key = script(llm_server, Round(text="fine"))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": key},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "echoed"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]
    r = http.post("/v1/turns", json={"messages": messages, "detach": True})
    assert r.status_code == 202, r.text
    assert client.wait(r.json()["turn_id"], timeout_s=30).type == "turn_finished"
    with pytest.raises(ValidationError, match="lone surrogate"):
        client._start_turn("a\ud800c")
    with pytest.raises(ValueError, match="lone surrogate"):
        client._start_turn(TurnRequest.model_construct(prompt="a\ud800c", messages=None))


# -- 4. credentials in log lines ---------------------------------------------------------


def test_uvicorn_factory_access_log_redacts_encoded_tokens(agentq_env: dict[str, str]) -> None:
    port = find_free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "agentq.gateway.app:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env={**os.environ, **agentq_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    secrets = [f"s3cr3t{i}{uuid.uuid4().hex[:6]}" for i in range(5)]
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base + "/healthz"), timeout_s=30)
        tid = "0" * 32
        for name, secret in zip(
            ("%74oken", "token", "%2574oken", "TOKEN", "api%5Fkey"), secrets, strict=True
        ):
            httpx.get(f"{base}/v1/turns/{tid}/events?{name}={secret}&heartbeat=1", timeout=5)
        httpx.get(
            f"{base}/healthz?x=1", headers={"Authorization": f"Bearer {secrets[0]}"}, timeout=5
        )
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert "/v1/turns/" in out and "heartbeat=1" in out, out
    for secret in secrets:
        assert secret not in out, out


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_redaction_rule_covers_every_encoding() -> None:
    from agentq.telemetry.redact import redact

    for line in (
        "GET /x?%74oken=SECRET&a=1",
        "GET /x?a=1&tok%65n=SECRET",
        "GET /x?%2574oken=SECRET",
        "GET /x?Token=SECRET",
        "GET /x?api_key=SECRET",
        "Authorization: Bearer SECRET",
        "{'authorization': 'Basic SECRET'}",
        "key sk-SECRETSECRETSECRETSECRET",
    ):
        assert "SECRET" not in redact(line), line
    assert redact("GET /x?after=1-0&heartbeat=2") == "GET /x?after=1-0&heartbeat=2"
