"""The stream worker's model round (`astream_round`) against the scripted server, over
real sockets: every watchdog case of the seeds on the path production runs.

Limits are tiny real values (a 300 ms silence limit); the tests wait on observable
state (server counters, callbacks) with deadlines, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentq.errors import (
    Aborted,
    MalformedStreamChunk,
    ModelHTTPError,
    StreamDurationExceeded,
    StreamIdleTimeout,
)
from agentq.llm.aclient import Attempt, astream_round, client_timeout, make_client
from agentq.models import AssistantMessage, Usage
from agentq.testing.openai_server import (
    Round,
    ScriptedCall,
    ScriptedOpenAIServer,
    demo_rounds,
    first_user_text,
)

pytestmark = pytest.mark.integration

IDLE_MS = 300
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedOpenAIServer]:
    with ScriptedOpenAIServer({"default": demo_rounds()}) as srv:
        # The SDK builds its chunk models lazily; pay for that before any timed test.
        warm = run(srv, "warm-up", idle_timeout_ms=0)
        assert warm.message is not None and warm.message.tool_calls
        srv.reset()
        yield srv


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves, once the server notices, no open stream."""
    srv: ScriptedOpenAIServer | None = None
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
    yield
    if srv is not None:
        wait_until(lambda: srv.open_streams == 0, what="streams to close")


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


@dataclass
class Outcome:
    message: AssistantMessage | None = None
    streamed_s: float = 0.0
    error: Exception | None = None
    deltas: list[tuple[str, str]] = field(default_factory=list)
    retries: list[tuple[int, Exception, float]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def text(self) -> str:
        return "".join(t for kind, t in self.deltas if kind == "text")


def run(
    server: ScriptedOpenAIServer,
    prompt: str,
    *,
    messages: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    on_retry: Callable[[int, Exception, float], None] | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    request_timeout_s: float = 5.0,
    **overrides: Any,
) -> Outcome:
    """One round on the stream worker's own path (`astream_round`), on a loop of its own."""
    out = Outcome()

    def _on_retry(attempt: int, exc: Exception, delay_s: float) -> None:
        out.retries.append((attempt, exc, delay_s))
        if on_retry is not None:
            on_retry(attempt, exc, delay_s)

    kwargs: dict[str, Any] = {
        "model": "scripted-test",
        "idle_timeout_ms": IDLE_MS,
        "duration_left_s": 30.0,
        "max_retries": 2,
        "turn_id": "turn-1",
    }
    kwargs.update(overrides)
    client = make_client(
        base_url=base_url or server.url,
        api_key=api_key,
        max_connections=10,
        timeout=client_timeout(request_timeout_s, kwargs["idle_timeout_ms"]),
    )

    async def go() -> None:
        abort = asyncio.Event()

        async def watch() -> None:
            # The cancel channel's part: it sets the event when the turn is aborted.
            while not cancelled():
                await asyncio.sleep(0.005)
            abort.set()

        watcher = asyncio.create_task(watch())
        try:
            attempt = Attempt(
                client=client,
                timeout=client_timeout(request_timeout_s, kwargs["idle_timeout_ms"]),
                on_delta=lambda kind, text: out.deltas.append((kind, text)),
                on_retry=_on_retry,
                abort=abort,
                **kwargs,
            )
            out.message, out.streamed_s = await astream_round(
                attempt, messages or [{"role": "user", "content": prompt}], json.dumps(tools or [])
            )
        except Exception as exc:
            out.error = exc
        finally:
            watcher.cancel()
            await client.close()

    started = time.monotonic()
    asyncio.run(go())
    out.elapsed_s = time.monotonic() - started
    return out


def requests_for(server: ScriptedOpenAIServer, prompt: str) -> list[dict[str, Any]]:
    return [r for r in server.requests if first_user_text(r["messages"]) == prompt]


def test_zero_chunk_stall_retries_twice_then_times_out(server: ScriptedOpenAIServer) -> None:
    server.set_script("stall-zero", [Round(text="never sent", fault="silent_after_200")])
    connections_before = server.connections_accepted
    out = run(server, "stall-zero")
    assert isinstance(out.error, StreamIdleTimeout)
    assert out.error.code == "ETIMEDOUT"
    assert out.error.chunks_received == 0
    assert out.error.idle_ms == IDLE_MS
    assert [attempt for attempt, _, _ in out.retries] == [1, 2]
    assert all(isinstance(exc, StreamIdleTimeout) for _, exc, _ in out.retries)
    # Each attempt reached the server, on a connection of its own (a stalled one is not
    # reused). On a loaded machine the server may get to the last only after the client
    # gave up on it (300 ms), and then drops it unread: it records two requests or three.
    wait_until(
        lambda: server.connections_accepted - connections_before >= 3, what="the third attempt"
    )
    assert server.connections_accepted - connections_before == 3
    assert 2 <= len(requests_for(server, "stall-zero")) <= 3
    assert out.deltas == []


def test_zero_chunk_stall_recovers_on_retry(server: ScriptedOpenAIServer) -> None:
    rnd = Round(text="second time lucky", fault="silent_after_200", fault_times=1)
    server.set_script("stall-once", [rnd])
    out = run(server, "stall-once")
    assert out.error is None
    assert out.message is not None and out.message.content == "second time lucky"
    assert len(out.retries) == 1
    assert out.streamed_s >= IDLE_MS / 1000


def test_stall_after_chunks_surfaces_without_retry(server: ScriptedOpenAIServer) -> None:
    rnd = Round(
        text="hello world and more",
        chunk_size=5,
        fault="silent_after_chunks",
        fault_after_chunks=2,
    )
    server.set_script("stall-mid", [rnd])
    out = run(server, "stall-mid")
    assert out.text == "hello worl"
    assert isinstance(out.error, StreamIdleTimeout)
    assert out.error.code == "ETIMEDOUT"
    assert out.error.chunks_received == 2
    assert out.retries == []
    assert len(requests_for(server, "stall-mid")) == 1


def test_keepalive_comments_do_not_reset_the_watchdog(server: ScriptedOpenAIServer) -> None:
    # A proxy or a stuck model keeping the socket warm: a comment every 50 ms, never a chunk.
    server.set_script("keepalive", [Round(text="x", fault="keepalive_only")])
    out = run(server, "keepalive")
    assert isinstance(out.error, StreamIdleTimeout)
    assert out.error.code == "ETIMEDOUT"
    assert out.error.chunks_received == 0
    assert [attempt for attempt, _, _ in out.retries] == [1, 2]
    assert len(requests_for(server, "keepalive")) == 3
    # Three attempts of IDLE_MS each plus two backoffs; a reset watchdog never ends.
    assert out.elapsed_s < 3 * (3 * IDLE_MS / 1000 + 2.0)


def test_keepalive_comments_after_chunks_do_not_reset_the_watchdog(
    server: ScriptedOpenAIServer,
) -> None:
    rnd = Round(text="abcdef", chunk_size=2, fault="keepalive_only", fault_after_chunks=2)
    server.set_script("keepalive-mid", [rnd])
    out = run(server, "keepalive-mid")
    assert isinstance(out.error, StreamIdleTimeout)
    assert out.error.chunks_received == 2
    assert out.text == "abcd"
    assert out.retries == []
    assert out.elapsed_s < 3 * IDLE_MS / 1000 + 2.0


def test_keepalive_only_stream_meets_the_duration_budget(server: ScriptedOpenAIServer) -> None:
    # With the silence limit off, only the duration budget's own clock can end it.
    server.set_script("keepalive-long", [Round(text="x", fault="keepalive_only")])
    out = run(server, "keepalive-long", idle_timeout_ms=0, duration_left_s=0.5, max_retries=0)
    assert isinstance(out.error, StreamDurationExceeded)
    assert out.error.elapsed_s >= 0.5
    assert 0.45 <= out.elapsed_s < 3.0


def test_abort_during_keepalive_comments_is_an_abort(server: ScriptedOpenAIServer) -> None:
    server.set_script("keepalive-abort", [Round(text="x", fault="keepalive_only")])

    def cancelled() -> bool:
        return server.open_streams > 0 and bool(requests_for(server, "keepalive-abort"))

    out = run(server, "keepalive-abort", idle_timeout_ms=10_000, cancelled=cancelled)
    assert isinstance(out.error, Aborted)
    assert out.elapsed_s < 3.0
    assert out.retries == []


def test_active_slow_stream_never_trips(server: ScriptedOpenAIServer) -> None:
    text = "".join(f"w{i:02d} " for i in range(12))
    server.set_script("slow-active", [Round(text=text, chunk_size=4, chunk_delay_ms=100)])
    out = run(server, "slow-active")
    assert out.error is None
    assert out.message is not None and out.message.content == text
    assert out.elapsed_s > 3 * IDLE_MS / 1000
    assert out.retries == []


def test_reasoning_only_chunks_keep_the_stream_alive(server: ScriptedOpenAIServer) -> None:
    rnd = Round(reasoning="thinking " * 6, text="ok", chunk_size=9, chunk_delay_ms=120)
    server.set_script("slow-thinking", [rnd])
    out = run(server, "slow-thinking")
    assert out.error is None
    assert out.message is not None
    assert out.message.reasoning == "thinking " * 6
    assert out.message.content == "ok"
    assert [k for k, _ in out.deltas].count("reasoning") == 6


def test_custom_limit_does_not_trip_at_the_default(server: ScriptedOpenAIServer) -> None:
    server.set_script("gap-400", [Round(text="abcdef", chunk_size=2, chunk_delay_ms=400)])
    assert isinstance(run(server, "gap-400").error, StreamIdleTimeout)
    out = run(server, "gap-400", idle_timeout_ms=600)
    assert out.error is None
    assert out.message is not None and out.message.content == "abcdef"


def test_custom_limit_trips_at_the_configured_silence(server: ScriptedOpenAIServer) -> None:
    server.set_script("stall-600", [Round(text="x", fault="silent_after_200")])
    out = run(server, "stall-600", idle_timeout_ms=600, max_retries=0)
    assert isinstance(out.error, StreamIdleTimeout)
    assert out.error.idle_ms == 600
    assert out.error.stream_lifetime_ms >= 550
    assert 0.55 <= out.elapsed_s < 3.0


def test_disabled_watchdog_lets_slow_streams_finish(server: ScriptedOpenAIServer) -> None:
    server.set_script("gap-500", [Round(text="abc", chunk_size=1, chunk_delay_ms=500)])
    out = run(server, "gap-500", idle_timeout_ms=0)
    assert out.error is None
    assert out.message is not None and out.message.content == "abc"
    assert out.elapsed_s >= 0.9


def test_abort_during_a_stall_is_an_abort(server: ScriptedOpenAIServer) -> None:
    server.set_script("stall-abort", [Round(text="x", fault="silent_after_200")])

    def cancelled() -> bool:
        return server.open_streams > 0 and bool(requests_for(server, "stall-abort"))

    out = run(server, "stall-abort", idle_timeout_ms=10_000, cancelled=cancelled)
    assert isinstance(out.error, Aborted)
    assert out.error.turn_id == "turn-1"
    assert out.elapsed_s < 3.0
    assert out.retries == []


def test_abort_during_backoff_beats_the_retry(server: ScriptedOpenAIServer) -> None:
    server.set_script("stall-then-abort", [Round(text="x", fault="silent_after_200")])
    aborted = threading.Event()
    out = run(
        server,
        "stall-then-abort",
        cancelled=aborted.is_set,
        on_retry=lambda *_: aborted.set(),
    )
    assert isinstance(out.error, Aborted)
    assert len(out.retries) == 1
    assert len(requests_for(server, "stall-then-abort")) == 1


def test_malformed_chunk_names_its_index(server: ScriptedOpenAIServer) -> None:
    rnd = Round(text="abcdefgh", chunk_size=2, fault="malformed", fault_after_chunks=2)
    server.set_script("malformed", [rnd])
    out = run(server, "malformed")
    assert isinstance(out.error, MalformedStreamChunk)
    assert out.error.chunk_index == 2
    assert "JSON" in out.error.detail
    assert out.text == "abcd"
    assert out.retries == []
    assert len(requests_for(server, "malformed")) == 1


def test_server_error_then_success_is_retried(server: ScriptedOpenAIServer) -> None:
    server.set_script("http-500", [Round(text="recovered", fault="http_500", fault_times=1)])
    out = run(server, "http-500")
    assert out.error is None
    assert out.message is not None and out.message.content == "recovered"
    assert len(out.retries) == 1
    attempt, exc, delay_s = out.retries[0]
    assert attempt == 1
    assert isinstance(exc, ModelHTTPError) and exc.status_code == 500 and exc.retryable
    assert delay_s > 0
    assert len(requests_for(server, "http-500")) == 2


def test_a_retry_honours_retry_after(server: ScriptedOpenAIServer) -> None:
    rnd = Round(text="after the wait", fault="http_500", fault_times=1, retry_after_s=0.6)
    server.set_script("http-500-wait", [rnd])
    out = run(server, "http-500-wait")
    assert out.error is None
    assert out.message is not None and out.message.content == "after the wait"
    [(_, exc, delay_s)] = out.retries
    assert isinstance(exc, ModelHTTPError) and exc.status_code == 500
    assert delay_s == pytest.approx(0.6)
    assert out.elapsed_s >= 0.55


def test_bad_request_fails_at_once_with_the_server_message(server: ScriptedOpenAIServer) -> None:
    rnd = Round(text="x", fault="http_400", fault_message="messages[0].content is too long")
    server.set_script("http-400", [rnd])
    out = run(server, "http-400")
    assert isinstance(out.error, ModelHTTPError)
    assert out.error.status_code == 400
    assert not out.error.retryable
    assert "messages[0].content is too long" in out.error.message
    assert out.retries == []
    assert len(requests_for(server, "http-400")) == 1


def test_connection_dropped_before_any_chunk_is_retried(server: ScriptedOpenAIServer) -> None:
    server.set_script("drop-early", [Round(text="back", fault="disconnect", fault_times=1)])
    out = run(server, "drop-early")
    assert out.error is None
    assert out.message is not None and out.message.content == "back"
    [(_, exc, _)] = out.retries
    assert isinstance(exc, ModelHTTPError) and exc.retryable


def test_connection_dropped_after_chunks_is_not_retried(server: ScriptedOpenAIServer) -> None:
    rnd = Round(text="abcdef", chunk_size=2, fault="disconnect", fault_after_chunks=1)
    server.set_script("drop-late", [rnd])
    out = run(server, "drop-late")
    assert isinstance(out.error, ModelHTTPError)
    assert out.text == "ab"
    assert out.retries == []


def test_tool_calls_are_assembled_from_split_deltas(server: ScriptedOpenAIServer) -> None:
    rnd = Round(
        text="calling",
        tool_calls=[
            ScriptedCall(name="search", arguments={"query": "celery time limits", "k": 3}),
            ScriptedCall(name="echo", arguments='{"text": "unterminated', id="call_custom"),
        ],
        chunk_size=3,
        usage=Usage(prompt_tokens=11, completion_tokens=7, total_tokens=18),
    )
    server.set_script("tools", [rnd])
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    out = run(server, "tools", tools=tools)
    assert out.error is None
    msg = out.message
    assert msg is not None
    assert msg.content == "calling"
    assert msg.finish_reason == "tool_calls"
    assert msg.usage == Usage(prompt_tokens=11, completion_tokens=7, total_tokens=18)
    first, second = msg.tool_calls
    assert (first.id, first.name) == ("call_r0_0", "search")
    assert json.loads(first.arguments) == {"query": "celery time limits", "k": 3}
    assert (second.id, second.name) == ("call_custom", "echo")
    assert second.arguments == '{"text": "unterminated'
    [body] = requests_for(server, "tools")
    assert body["tools"] == tools
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_a_server_that_never_answers_is_cut_by_the_watchdog(server: ScriptedOpenAIServer) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        # Never accepted: the kernel completes the handshake and nobody ever answers.
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        out = run(server, "mute", base_url=url, max_retries=0, request_timeout_s=5.0)
        assert isinstance(out.error, StreamIdleTimeout)
        assert out.error.chunks_received == 0
        assert out.elapsed_s < 2.0

        started = time.monotonic()
        out = run(
            server,
            "mute",
            base_url=url,
            idle_timeout_ms=10_000,
            cancelled=lambda: time.monotonic() - started > 0.1,
        )
        assert isinstance(out.error, Aborted)
        assert out.elapsed_s < 2.0


def test_watchdog_trip_closes_the_socket(server: ScriptedOpenAIServer) -> None:
    server.set_script("socket-freed", [Round(text="x", fault="keepalive_only")])
    before = server.closed_by_client
    out = run(server, "socket-freed", max_retries=0)
    assert isinstance(out.error, StreamIdleTimeout)
    wait_until(lambda: server.open_streams == 0, timeout_s=2.0, what="the stream to close")
    wait_until(lambda: server.closed_by_client > before, timeout_s=2.0, what="the close")


def test_stream_duration_is_checked_between_chunks(server: ScriptedOpenAIServer) -> None:
    server.set_script("too-long", [Round(text="x" * 20, chunk_size=1, chunk_delay_ms=50)])
    out = run(server, "too-long", duration_left_s=0.3)
    assert isinstance(out.error, StreamDurationExceeded)
    assert out.error.limit_s == 0.3 and out.error.elapsed_s >= 0.3
    assert out.retries == []


def test_no_duration_left_fails_before_any_request(server: ScriptedOpenAIServer) -> None:
    out = run(server, "no-time-left", duration_left_s=0.0)
    assert isinstance(out.error, StreamDurationExceeded)
    assert requests_for(server, "no-time-left") == []


def test_rounds_are_chosen_statelessly(server: ScriptedOpenAIServer) -> None:
    server.set_script("multi", [Round(text="first"), Round(text="second"), Round(text="third")])
    server.set_script("multi special", [Round(text="special")])
    user = {"role": "user", "content": "multi please"}
    assistant = {"role": "assistant", "content": "..."}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}

    def answer(messages: list[dict[str, Any]]) -> str:
        out = run(server, "", messages=messages)
        assert out.error is None and out.message is not None
        return out.message.content

    # Out of order and interleaved: only the request decides the round.
    assert answer([user, assistant, tool, assistant]) == "third"
    assert answer([user]) == "first"
    assert answer([user, assistant, tool]) == "second"
    assert answer([user, assistant, assistant, assistant]) == "done."
    assert answer([{"role": "user", "content": "multi special one"}]) == "special"
    parts = [{"type": "text", "text": "multi "}, {"type": "text", "text": "special"}]
    assert answer([{"role": "user", "content": parts}]) == "special"
    assert answer([{"role": "user", "content": "unscripted"}]) == demo_rounds()[0].text


def test_concurrent_conversations_share_one_server(server: ScriptedOpenAIServer) -> None:
    server.set_script("conc", [Round(text="one", chunk_delay_ms=20), Round(text="two")])
    results: dict[int, Outcome] = {}

    def worker(i: int) -> None:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"conc {i}"}]
        if i % 2:
            msgs.append({"role": "assistant", "content": "one"})
        # This test is about the server; a generous limit keeps a busy machine from tripping it.
        results[i] = run(server, "", messages=msgs, idle_timeout_ms=10_000)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in results.items():
        assert out.message is not None, out.error
        assert out.message.content == ("two" if i % 2 else "one")


def test_non_streaming_and_models_endpoints(server: ScriptedOpenAIServer) -> None:
    server.set_script("plain", [Round(text="plain answer", reasoning="hmm")])
    body = {"model": "m", "messages": [{"role": "user", "content": "plain"}]}
    with httpx.Client(base_url=server.url, timeout=5) as client:
        completion = client.post("/chat/completions", json=body).json()
        models = client.get("/models").json()
        missing = client.get("/nowhere")
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"] == "plain answer"
    assert completion["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert completion["usage"]["total_tokens"] > 0
    assert models["data"][0]["id"] == "scripted"
    assert missing.status_code == 404


def test_server_stops_promptly_with_silent_streams_open() -> None:
    srv = ScriptedOpenAIServer({"default": [Round(fault="silent_after_200")]}).start()
    host, port = srv.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        wait_until(lambda: srv.open_streams == 1, what="the stream to open")
        started = time.monotonic()
        srv.stop()
        assert time.monotonic() - started < 1.0
    assert srv.open_streams == 0
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
        pass


def test_cli_serves_the_demo_script_until_sigterm(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    script_file = tmp_path / "script.json"
    script_file.write_text(json.dumps({"custom": [{"text": "from the file"}]}))
    cmd = [sys.executable, "-m", "agentq.testing.openai_server", "--port", "0", "--script", "demo"]
    cmd += ["--script-file", str(script_file)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line.startswith("listening on http://127.0.0.1:")
            url = line.removeprefix("listening on ")
            models = httpx.get(f"{url}/models", timeout=5).json()
            assert models["object"] == "list"
            for prompt, text in (("custom prompt", "from the file"), ("hi", "Running two")):
                body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
                answer = httpx.post(f"{url}/chat/completions", json=body, timeout=5).json()
                assert answer["choices"][0]["message"]["content"].startswith(text)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=5) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
