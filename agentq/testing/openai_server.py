"""A real OpenAI-compatible HTTP server that answers from scripts.

Tests point the real `openai` SDK at it to exercise streaming, stalls, HTTP errors
and malformed chunks over real sockets; `agentq dev` uses `demo_rounds()` when no
model is configured.

The round to answer is chosen from the request alone (the number of assistant
messages already in `messages`), and the script from the first user message, so
any number of concurrent conversations can share one server.

    python -m agentq.testing.openai_server --port 0 --script demo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from agentq.models import Usage

Fault = Literal[
    "silent_after_200",
    "silent_after_chunks",
    "keepalive_only",
    "http_500",
    "http_429",
    "http_400",
    "malformed",
    "disconnect",
]

DEFAULT_KEY = "default"
_POLL_S = 0.05
_STOP_GRACE_S = 0.5
_HTTP_FAULTS: dict[str, tuple[int, str, str]] = {
    "http_500": (500, "server_error", "scripted fault: internal server error"),
    "http_429": (429, "rate_limit_exceeded", "scripted fault: rate limit reached"),
    "http_400": (400, "invalid_request_error", "scripted fault: invalid request"),
}


class ScriptedCall(BaseModel):
    """One tool call the scripted model makes."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    """A dict is sent as JSON; a str is sent verbatim, so tests can send invalid JSON."""
    id: str | None = None

    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments)


class Round(BaseModel):
    """What the scripted model answers to one request of a conversation."""

    model_config = ConfigDict(extra="forbid")

    text: str = ""
    reasoning: str = ""
    """Streamed as `delta.reasoning_content` before the text."""
    tool_calls: list[ScriptedCall] = Field(default_factory=list)
    chunk_size: int = Field(default=8, ge=1)
    """Characters per text, reasoning or arguments delta."""
    chunk_delay_ms: int = Field(default=0, ge=0)
    """Pause before every chunk after the first."""
    fault: Fault | None = None
    fault_after_chunks: int = Field(default=0, ge=0)
    """For the mid-stream faults: how many data chunks go out before the fault."""
    fault_times: int = -1
    """Apply the fault on the first N attempts of this round, then answer normally; -1: always."""
    fault_message: str | None = None
    """Error text of an HTTP fault; a default names the fault."""
    retry_after_s: float | None = None
    """Sent with http_429 as `retry-after-ms` and a rounded-up `Retry-After`."""
    usage: Usage | None = None
    raw_chunks: list[str] | None = None
    """Sent verbatim as the stream's `data:` lines (then `[DONE]`) instead of the above:
    arbitrary JSON, fragments or garbage, for fuzzing the stream worker."""


Script = list[Round]
"""Round i answers the request that already holds i assistant messages."""

_SCRIPTS = TypeAdapter(dict[str, Script])


def demo_rounds() -> Script:
    """The `agentq dev` script: two parallel tool calls, then a short summary."""
    return [
        Round(
            reasoning="The user wants a demo: call echo and sleep at the same time.",
            text="Running two tools in parallel.",
            tool_calls=[
                ScriptedCall(name="echo", arguments={"text": "hello"}),
                ScriptedCall(name="sleep", arguments={"seconds": 2}),
            ],
            chunk_size=6,
            chunk_delay_ms=20,
        ),
        Round(
            text="Both tools finished: echo returned 'hello' and sleep waited 2 seconds.",
            chunk_size=6,
            chunk_delay_ms=20,
        ),
    ]


def first_user_text(messages: Sequence[Any]) -> str:
    """The text of the first user message; content parts are joined."""
    for msg in messages:
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            return ""
    return ""


def system_text(messages: Sequence[Any]) -> str:
    """The text of the first system message (an agent's instructions), or ""."""
    for msg in messages:
        if isinstance(msg, Mapping) and msg.get("role") == "system":
            content = msg.get("content")
            return content if isinstance(content, str) else ""
    return ""


def script_key(scripts: Mapping[str, Any], user: str, system: str, model: str) -> str:
    """Which script answers: the longest key the first user message starts with, else
    `system:<prefix>` of the instructions, else `model:<name>`, else "default"."""
    plain = [
        k
        for k in scripts
        if k != DEFAULT_KEY and not k.startswith(("system:", "model:")) and user.startswith(k)
    ]
    if plain:
        return max(plain, key=len)
    by_system = [
        k for k in scripts if k.startswith("system:") and system and system.startswith(k[7:])
    ]
    if by_system:
        return max(by_system, key=len)
    if f"model:{model}" in scripts:
        return f"model:{model}"
    return DEFAULT_KEY


def round_index(messages: Sequence[Any]) -> int:
    """Which round a request asks for: the assistant messages it already holds."""
    return sum(1 for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant")


class _ClientGone(Exception):
    """The client closed its end while we were answering."""


@dataclass
class _Plan:
    round: Round
    index: int
    fault: Fault | None
    model: str


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # A stream worker opens a thousand streams at once: keep their connects queued.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], owner: ScriptedOpenAIServer) -> None:
        super().__init__(address, _Handler)
        self.owner = owner
        self._handlers_lock = threading.Lock()
        self._handlers: dict[threading.Thread, socket.socket] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        # server_close() does not join daemon handler threads, so we track them ourselves.
        thread = threading.Thread(
            target=self._serve_one,
            args=(request, client_address),
            name="scripted-openai-handler",
            daemon=True,
        )
        with self._handlers_lock:
            self._handlers[thread] = request
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._handlers_lock:
                self._handlers.pop(threading.current_thread(), None)

    def join_handlers(self, grace_s: float) -> None:
        """Join every handler; cut the connections of those still busy after `grace_s`."""
        with self._handlers_lock:
            handlers = list(self._handlers.items())
        deadline = time.monotonic() + grace_s
        for thread, _ in handlers:
            thread.join(max(deadline - time.monotonic(), 0.0))
        for thread, sock in handlers:
            if thread.is_alive():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread, _ in handlers:
            thread.join()


class ScriptedOpenAIServer:
    """An OpenAI-compatible server on 127.0.0.1 answering from `scripts`.

    A script is chosen by the longest key the first user message starts with, else by
    a `system:<prefix>` key the system message (an agent's instructions) starts with,
    else by a `model:<name>` key naming the request's model, else "default"; past the
    end of its script a conversation gets the text "done.". Keys by instructions or model
    script an agent's rounds whatever prompt another agent gives it.
    """

    def __init__(
        self,
        scripts: Mapping[str, Sequence[Round]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "scripted",
    ) -> None:
        self.scripts: dict[str, list[Round]] = {k: list(v) for k, v in (scripts or {}).items()}
        self.requests: list[dict[str, Any]] = []
        self.model = model
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._attempts: dict[tuple[str, int, str], int] = {}
        self._open_streams = 0
        self._closed_by_client = 0
        self._stop = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    @property
    def open_streams(self) -> int:
        """Streaming responses currently open."""
        with self._lock:
            return self._open_streams

    @property
    def closed_by_client(self) -> int:
        """Responses the client closed before we finished them."""
        with self._lock:
            return self._closed_by_client

    def set_script(self, key: str, rounds: Sequence[Round]) -> None:
        with self._lock:
            self.scripts[key] = list(rounds)

    def reset(self) -> None:
        """Forget received requests and fault attempt counts."""
        with self._lock:
            self.requests.clear()
            self._attempts.clear()
            self._closed_by_client = 0

    def start(self) -> ScriptedOpenAIServer:
        if self._httpd is not None:
            return self
        self._stop.clear()
        httpd = _HTTPServer((self._host, self._port), self)
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="scripted-openai-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end held streams, free the port and join every thread."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stop.set()
        httpd.shutdown()
        if thread is not None:
            thread.join()
        # Held streams notice the stop event within a poll; a handler stuck reading a
        # request that never comes is cut loose.
        httpd.join_handlers(grace_s=_STOP_GRACE_S)
        httpd.server_close()
        self._httpd = None
        self._thread = None

    def __enter__(self) -> ScriptedOpenAIServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _record(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(body)

    def _count_stream(self, delta: int) -> None:
        with self._lock:
            self._open_streams += delta

    def _client_gone(self) -> None:
        with self._lock:
            self._closed_by_client += 1

    def _plan(self, body: Mapping[str, Any]) -> _Plan:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        user = first_user_text(messages)
        index = round_index(messages)
        with self._lock:
            key = script_key(self.scripts, user, system_text(messages), str(body.get("model")))
            script = self.scripts.get(key, [])
            rnd = script[index] if index < len(script) else Round(text="done.")
            counter = (key, index, user)
            attempt = self._attempts.get(counter, 0) + 1
            self._attempts[counter] = attempt
        applies = rnd.fault is not None and (rnd.fault_times < 0 or attempt <= rnd.fault_times)
        model = body.get("model")
        return _Plan(rnd, index, rnd.fault if applies else None, str(model or self.model))


def _usage(rnd: Round, body: Mapping[str, Any]) -> dict[str, int]:
    if rnd.usage is not None:
        return rnd.usage.model_dump()
    prompt = len(json.dumps(body.get("messages", []))) // 4 + 1
    completion = (
        len(rnd.text) + len(rnd.reasoning) + sum(len(c.arguments_json()) for c in rnd.tool_calls)
    ) // 4 + 1
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _call(plan: _Plan, position: int, call: ScriptedCall, arguments: str) -> dict[str, Any]:
    call_id = call.id or f"call_r{plan.index}_{position}"
    function = {"name": call.name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def _deltas(plan: _Plan) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(delta, finish_reason) of every choice chunk, in the order OpenAI sends them."""
    rnd = plan.round
    for piece in _pieces(rnd.reasoning, rnd.chunk_size):
        yield {"reasoning_content": piece}, None
    for piece in _pieces(rnd.text, rnd.chunk_size):
        yield {"content": piece}, None
    for position, call in enumerate(rnd.tool_calls):
        yield {"tool_calls": [{"index": position, **_call(plan, position, call, "")}]}, None
        for piece in _pieces(call.arguments_json(), rnd.chunk_size):
            yield {"tool_calls": [{"index": position, "function": {"arguments": piece}}]}, None
    yield {}, "tool_calls" if rnd.tool_calls else "stop"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentq-scripted/1"
    # Bounds a read of a request that never arrives; held streams poll instead.
    timeout = 10

    @property
    def owner(self) -> ScriptedOpenAIServer:
        return cast(_HTTPServer, self.server).owner

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read `server.requests` instead."""

    def do_GET(self) -> None:
        self.close_connection = True
        if self.path.rstrip("/") == "/v1/models":
            data = [{"id": self.owner.model, "object": "model", "created": 0, "owned_by": "agentq"}]
            self._json(200, {"object": "list", "data": data})
        else:
            self._error(404, "not_found", f"no route GET {self.path}")

    def do_POST(self) -> None:
        self.close_connection = True
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, "not_found", f"no route POST {self.path}")
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except ValueError as exc:
            self._error(400, "invalid_request_error", f"request body is not JSON: {exc}")
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self._error(400, "invalid_request_error", "'messages' must be a list")
            return
        owner = self.owner
        owner._record(body)
        plan = owner._plan(body)
        if plan.fault in _HTTP_FAULTS:
            status, kind, message = _HTTP_FAULTS[plan.fault]
            self._error(status, kind, plan.round.fault_message or message, plan.round.retry_after_s)
            return
        try:
            if body.get("stream"):
                self._stream(plan, body)
            else:
                self._complete(plan, body)
        except _ClientGone:
            owner._client_gone()

    def _json(self, status: int, payload: object, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _send(self, status: int, raw: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Connection", "close")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(raw)
        except OSError:
            self.owner._client_gone()

    def _error(
        self, status: int, kind: str, message: str, retry_after_s: float | None = None
    ) -> None:
        headers: dict[str, str] = {}
        if retry_after_s is not None:
            headers["retry-after-ms"] = str(int(retry_after_s * 1000))
            headers["Retry-After"] = str(max(1, int(-(-retry_after_s // 1))))
        error = {"message": message, "type": kind, "param": None, "code": kind}
        self._json(status, {"error": error}, headers)

    def _complete(self, plan: _Plan, body: Mapping[str, Any]) -> None:
        rnd = plan.round
        if plan.fault in ("silent_after_200", "silent_after_chunks", "keepalive_only"):
            self._hold(keepalive=False)
            return
        if plan.fault == "disconnect":
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if plan.fault == "malformed":
            self._send(200, b"{not json")
            return
        message: dict[str, Any] = {"role": "assistant", "content": rnd.text or None}
        if rnd.reasoning:
            message["reasoning_content"] = rnd.reasoning
        if rnd.tool_calls:
            calls = enumerate(rnd.tool_calls)
            message["tool_calls"] = [_call(plan, i, c, c.arguments_json()) for i, c in calls]
        finish = "tool_calls" if rnd.tool_calls else "stop"
        choice = {"index": 0, "message": message, "finish_reason": finish}
        completion = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": plan.model,
            "choices": [choice],
            "usage": _usage(rnd, body),
        }
        self._json(200, completion)

    def _stream(self, plan: _Plan, body: Mapping[str, Any]) -> None:
        rnd = plan.round
        owner = self.owner
        # Counted before the headers go out, so a client holding the response sees it.
        owner._count_stream(+1)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self._stream_body(plan, body, rnd)
        finally:
            owner._count_stream(-1)

    def _stream_body(self, plan: _Plan, body: Mapping[str, Any], rnd: Round) -> None:
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": plan.model,
        }
        if rnd.raw_chunks is not None:
            for raw in rnd.raw_chunks:
                self._event(raw)
            self._event("[DONE]")
            self._send_frame(b"0\r\n\r\n")
            return
        fault_at = 0 if plan.fault == "silent_after_200" else rnd.fault_after_chunks
        delay_s = rnd.chunk_delay_ms / 1000
        sent = 0
        for delta, finish in _deltas(plan):
            if sent == fault_at and self._fault(plan):
                return
            if sent and delay_s and self.owner._stop.wait(delay_s):
                return
            if sent == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            self._event(json.dumps({**base, "choices": [choice]}))
            sent += 1
        if sent <= fault_at and self._fault(plan):
            return
        options = body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage"):
            self._event(json.dumps({**base, "choices": [], "usage": _usage(rnd, body)}))
        self._event("[DONE]")
        self._send_frame(b"0\r\n\r\n")

    def _fault(self, plan: _Plan) -> bool:
        """Play a mid-stream fault; True when the stream must end here."""
        fault = plan.fault
        if fault in ("silent_after_200", "silent_after_chunks"):
            self._hold(keepalive=False)
            return True
        if fault == "keepalive_only":
            self._hold(keepalive=True)
            return True
        if fault == "disconnect":
            # No terminating chunk: the client sees the body cut short.
            self.connection.shutdown(socket.SHUT_RDWR)
            return True
        if fault == "malformed":
            self._event("{not json")
            plan.fault = None
        return False

    def _event(self, data: str) -> None:
        self._write(f"data: {data}\n\n".encode())

    def _write(self, payload: bytes) -> None:
        self._send_frame(b"%x\r\n%s\r\n" % (len(payload), payload))

    def _send_frame(self, frame: bytes) -> None:
        try:
            self.wfile.write(frame)
        except OSError as exc:
            raise _ClientGone from exc

    def _hold(self, *, keepalive: bool) -> None:
        """Keep the connection open, sending no data, until the client leaves or we stop."""
        sock = self.connection
        while not self.owner._stop.is_set():
            if keepalive:
                self._write(b": keep-alive\n\n")
            readable, _, _ = select.select([sock], [], [], _POLL_S)
            if readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    raise _ClientGone


def _load_script_file(path: str) -> dict[str, Script]:
    return _SCRIPTS.validate_json(Path(path).read_bytes())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentq.testing.openai_server",
        description="Serve a scripted OpenAI-compatible model.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", choices=["demo", "none"], default="demo")
    parser.add_argument("--script-file", help='JSON: {"key": [round, ...]}')
    args = parser.parse_args(argv)

    scripts: dict[str, list[Round]] = {}
    if args.script == "demo":
        scripts[DEFAULT_KEY] = demo_rounds()
        from agentq.testing.agents import demo_scripts

        scripts.update(demo_scripts())
    if args.script_file:
        scripts.update(_load_script_file(args.script_file))

    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with ScriptedOpenAIServer(scripts, host=args.host, port=args.port) as server:
        print(f"listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
