"""Property-based tests (hypothesis) of the HTTP API and of the model's stream (issue 17).

Bounded: a few dozen examples each, no deadline, well under a minute in all. The HTTP
fuzz sends random bodies, ids, headers and Last-Event-ID values to the real gateway
over a real Redis; the stream fuzz has the scripted model send arbitrary chunks (tool
call fragments, usage, garbage) through real turns on the real workers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentq.api import Client
from agentq.events import TERMINAL_TYPES
from agentq.gateway import create_app
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HTTP_EXAMPLES = 60
STREAM_EXAMPLES = 10
FUZZ = settings(
    max_examples=HTTP_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client(), heartbeat_s=0.2, poll_s=0.2)) as server:
        yield server


@pytest.fixture(scope="module")
def http(gateway: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(20.0)) as c:
        yield c


@pytest.fixture(scope="module")
def ended_turn(http: httpx.Client) -> dict[str, Any]:
    r = http.post("/v1/turns", json={"prompt": f"fuzz-{uuid.uuid4().hex}", "detach": True})
    assert r.status_code == 202, r.text
    Client().wait(r.json()["turn_id"], timeout_s=30)
    return dict(r.json())


# -- the HTTP API --------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"])},
    optional={
        "content": st.one_of(st.text(max_size=20), json_values),
        "tool_calls": st.lists(json_values, max_size=2),
        "tool_call_id": st.text(max_size=10),
    },
)
start_body = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(st.text(max_size=30), json_values),
        "messages": st.one_of(st.lists(message, max_size=3), json_values),
        "detach": st.just(True),
        "headless": st.one_of(st.booleans(), json_values),
        "conversation_id": st.text(max_size=20),
    },
)
ids = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789abcdefABCDEF:-%./", min_size=30, max_size=40),
    st.just("0" * 32),
)
stream_ids = st.one_of(
    st.text(max_size=30),
    st.builds(lambda a, b: f"{a}-{b}", st.integers(-5, 2**70), st.integers(-5, 2**70)),
    st.integers(0, 2**80).map(str),
)
# Header values are latin-1 text without line breaks.
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=40)


def _header(value: str) -> bytes:
    """`value` as raw header bytes (UTF-8, non-ASCII kept) that HTTP/1.1 can carry."""
    raw = bytes(b for b in value.encode("utf-8") if b >= 0x20 and b != 0x7F)
    return raw.strip(b" \t")


def _no_5xx(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text)
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        err = r.json()["error"]
        assert err["type"] and err["message"]


@FUZZ
@given(body=st.one_of(start_body.map(lambda b: json.dumps(b).encode()), st.binary(max_size=200)))
def test_fuzz_start_bodies(http: httpx.Client, body: bytes) -> None:
    _no_5xx(http.post("/v1/turns", content=body, headers={"Content-Type": "application/json"}))


def _controls_escaped(text: str) -> str:
    """Percent-encode ASCII control characters, which httpx refuses in a URL before it
    sends anything: the server still gets them, escaped, as any client would send them."""
    return "".join(quote(c) if c.isascii() and not c.isprintable() else c for c in text)


@FUZZ
@given(
    which=st.sampled_from(["get", "events", "abort", "answer"]),
    turn_id=ids,
    request_id=ids,
    last_event_id=st.one_of(stream_ids, header_text),
    bearer=header_text,
    body=st.binary(max_size=80) | json_values.map(lambda v: json.dumps(v).encode()),
    use_ended=st.booleans(),
)
# Found by a CI run: a control character, which httpx refuses unescaped.
@example(
    which="answer",
    turn_id="\x1f",
    request_id="\x00",
    last_event_id="",
    bearer="",
    body=b"",
    use_ended=False,
)
def test_fuzz_turn_paths_ids_and_headers(
    http: httpx.Client,
    ended_turn: dict[str, Any],
    which: str,
    turn_id: str,
    request_id: str,
    last_event_id: str,
    bearer: str,
    body: bytes,
    use_ended: bool,
) -> None:
    tid = ended_turn["turn_id"] if use_ended else turn_id
    quoted_tid = httpx.URL(f"/v1/turns/{_controls_escaped(tid)}").raw_path.decode()
    headers = {
        "Authorization": _header("Bearer " + bearer),
        "Last-Event-ID": _header(last_event_id),
    }
    if which == "get":
        r = http.get(quoted_tid, headers=headers)
    elif which == "abort":
        r = http.post(f"{quoted_tid}/abort", headers=headers)
    elif which == "answer":
        path = f"/v1/turns/{_controls_escaped(tid)}/interactions/{_controls_escaped(request_id)}"
        url = httpx.URL(path).raw_path.decode()
        r = http.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        # A stream of an ended turn replays and ends; of nothing, it is refused.
        with http.stream("GET", f"{quoted_tid}/events", headers=headers) as resp:
            resp.read()
            r = resp
    _no_5xx(r)


# -- the model's stream ------------------------------------------------------------------

fragment = st.one_of(st.text(max_size=8), st.sampled_from(['{"text": "', "hi", '"}', "{}", "{"]))
tool_call_delta = st.fixed_dictionaries(
    {"index": st.integers(0, 2)},
    optional={
        "id": st.one_of(st.sampled_from(["call_a", "call_b", ""]), st.text(max_size=6)),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {},
            optional={
                "name": st.sampled_from(["echo", "nosuchtool", "", "ech"]),
                "arguments": fragment,
            },
        ),
    },
)
delta = st.fixed_dictionaries(
    {},
    optional={
        "content": st.one_of(st.none(), st.text(max_size=10)),
        "tool_calls": st.lists(tool_call_delta, max_size=2),
        "role": st.just("assistant"),
    },
)
choice_chunk = st.builds(
    lambda d, finish: json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
        }
    ),
    delta,
    st.sampled_from([None, None, "stop", "tool_calls", "length"]),
)
usage_chunk = st.builds(
    lambda n: json.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": n, "completion_tokens": n, "total_tokens": 2 * n},
        }
    ),
    st.integers(-1, 100),
)
garbage = st.one_of(
    st.text(st.characters(blacklist_categories=["Cs", "Cc"]), max_size=20),
    json_values.map(json.dumps),
)
chunks = st.lists(st.one_of(choice_chunk, choice_chunk, usage_chunk, garbage), max_size=8)


@settings(
    max_examples=STREAM_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
@given(raw=chunks)
def test_fuzz_model_stream_through_real_turns(
    http: httpx.Client, llm_server: Any, raw: list[str]
) -> None:
    key = f"fz-{uuid.uuid4().hex[:10]}"
    llm_server.set_script(key, [Round(raw_chunks=raw), Round(text="done.")])
    r = http.post("/v1/turns", json={"prompt": key, "detach": True, "headless": True})
    assert r.status_code == 202, r.text
    tid = r.json()["turn_id"]
    client = Client()
    terminal = client.wait(tid, timeout_s=45)
    assert terminal.type in TERMINAL_TYPES
    log = client._store.bus.replay(tid)
    ends = [i for i, e in enumerate(log) if e.type in TERMINAL_TYPES]
    assert ends == [len(log) - 1], [e.type for e in log]
    got = http.get(f"/v1/turns/{tid}")
    _no_5xx(got)
    history = got.json()["history"]
    asked = [
        c["id"] for m in history if m.get("role") == "assistant" for c in m.get("tool_calls") or []
    ]
    answered = [m["tool_call_id"] for m in history if m.get("role") == "tool"]
    assert sorted(asked) == sorted(answered), (asked, answered)
    assert len(set(answered)) == len(answered), answered
    settled = [e.fields["call_id"] for e in log if e.type == "tool_finished"]
    assert len(set(settled)) == len(settled), settled
