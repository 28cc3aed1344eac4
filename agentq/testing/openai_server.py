"""A real OpenAI-compatible HTTP server that answers from scripts.

Tests point the real `openai` SDK at it to exercise streaming, stalls, HTTP errors
and malformed chunks over real sockets; `agentq dev` uses `demo_rounds()` when no
model is configured.

The round to answer is chosen from the request alone (the number of assistant
messages already in `messages`), and the script from the first user message, so
any number of concurrent conversations can share one server. It serves them from one
asyncio loop in one thread (`agentq.testing.http_loop`) over keep-alive connections, so a
thousand slow streams cost sockets, not threads.

    python -m agentq.testing.openai_server --port 0 --script demo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from agentq.fleet.lifecycle import Started
from agentq.models import Usage
from agentq.testing.http_loop import BackgroundHTTPServer
from agentq.testing.http_wire import ClientGone, Conn, Request, error_body
from agentq.testing.ratelimit import SHAPES, ProviderLimits

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
_KEEPALIVE_S = 0.05
"""Between the SSE comments of a `keepalive_only` hold."""
_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
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
    """The pace of the stream: chunk i goes out i * chunk_delay_ms after the first."""
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
    """The usage reported (`cached_tokens` as `prompt_tokens_details`); unset: counted at 4
    characters a token. The completion stops at the request's `max_completion_tokens`."""
    omit_usage: bool = False
    """Send no usage chunk even when the request asks for one (a server that omits it)."""
    raw_chunks: list[str] | None = None
    """Sent verbatim as the stream's `data:` lines (then `[DONE]`) instead of the above:
    arbitrary JSON, fragments or garbage, for fuzzing the stream worker."""

    def chunk_count(self) -> int:
        """Its data chunks (a usage chunk aside): it lasts (count - 1) * `chunk_delay_ms`."""
        if self.raw_chunks is not None:
            return len(self.raw_chunks)
        return sum(1 for _ in _deltas(_Plan(self, 0, None, "")))


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


@dataclass
class _Plan:
    round: Round
    index: int
    fault: Fault | None
    model: str


class ScriptedOpenAIServer(Started):
    """An OpenAI-compatible server on 127.0.0.1 answering from `scripts`.

    A script is chosen by the longest key the first user message starts with, else by a
    `system:<prefix>` key the system message (an agent's instructions) starts with, else by
    a `model:<name>` key naming the request's model, else "default"; past its end a
    conversation gets "done.". Keys by instructions or model script an agent's rounds.
    """

    def __init__(
        self,
        scripts: Mapping[str, Sequence[Round]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "scripted",
        limits: ProviderLimits | None = None,
        api_key: str | None = None,
    ) -> None:
        self.limits = limits or ProviderLimits()
        """The provider's rate limits and overloaded answers (off unless set)."""
        self.api_key = api_key
        """When set, a request without `Authorization: Bearer <api_key>` gets OpenAI's 401."""
        self.scripts: dict[str, list[Round]] = {k: list(v) for k, v in (scripts or {}).items()}
        self.requests: list[dict[str, Any]] = []
        self.model = model
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._attempts: dict[tuple[str, int, str], int] = {}
        self._open_streams = 0
        self._closed_by_client = 0
        self._http: BackgroundHTTPServer | None = None

    @property
    def url(self) -> str:
        if self._http is None:
            raise RuntimeError("the server is not started")
        host, port = self._http.address
        return f"http://{host}:{port}/v1"

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

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted since start(): with keep-alive, fewer than requests."""
        return 0 if self._http is None else self._http.connections_accepted

    def set_script(self, key: str, rounds: Sequence[Round]) -> None:
        with self._lock:
            self.scripts[key] = list(rounds)

    def reset(self) -> None:
        """Forget received requests, fault attempt counts and rate-limit counts."""
        with self._lock:
            self.requests.clear()
            self._attempts.clear()
            self._closed_by_client = 0
        self.limits.reset()

    def start(self) -> ScriptedOpenAIServer:
        if self._http is not None:
            return self
        http = BackgroundHTTPServer(
            self._answer, host=self._host, port=self._port, name="scripted-openai-server"
        )
        http.start()
        self._http = http
        return self

    def stop(self) -> None:
        """Stop serving, cut every connection and stream, free the port and join the thread."""
        http, self._http = self._http, None
        if http is not None:
            http.stop()

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

    async def _answer(self, conn: Conn, request: Request) -> bool:
        """Answer one request on the server's loop; False when the connection is spent."""
        try:
            return await self._route(conn, request)
        except ClientGone:
            self._client_gone()
            return False

    async def _route(self, conn: Conn, request: Request) -> bool:
        route = request.path.rstrip("/")
        if request.method == "GET":
            if route == "/v1/models":
                data = [{"id": self.model, "object": "model", "created": 0, "owned_by": "agentq"}]
                return await _json(conn, 200, {"object": "list", "data": data})
            return await _error(conn, 404, "not_found", f"no route GET {request.target}")
        if request.method != "POST":
            return await _error(conn, 405, "method_not_allowed", f"{request.method} not served")
        if route != "/v1/chat/completions":
            return await _error(conn, 404, "not_found", f"no route POST {request.target}")
        key = self.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            return await _error(conn, 401, "invalid_api_key", "Incorrect API key provided")
        try:
            body = json.loads(request.body or b"null")
        except ValueError as exc:
            msg = f"request body is not JSON: {exc}"
            return await _error(conn, 400, "invalid_request_error", msg)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return await _error(conn, 400, "invalid_request_error", "'messages' must be a list")
        self._record(body)
        plan = self._plan(body)
        usage = _usage(plan.round, body)
        verdict = self.limits.check(time.time(), usage["total_tokens"])
        if verdict.status != 200:
            return await _error(
                conn, verdict.status, verdict.kind, verdict.message, headers=verdict.headers
            )
        if plan.fault in _HTTP_FAULTS:
            status, kind, message = _HTTP_FAULTS[plan.fault]
            rnd = plan.round
            return await _error(conn, status, kind, rnd.fault_message or message, rnd.retry_after_s)
        answer = _Answer(self, conn, plan, body, verdict.headers)
        return await (answer.stream() if body.get("stream") else answer.complete())


def _usage(rnd: Round, body: Mapping[str, Any]) -> dict[str, Any]:
    """The round's usage as OpenAI reports it."""
    cached = 0
    if rnd.usage is not None:
        prompt, completion = rnd.usage.prompt_tokens, rnd.usage.completion_tokens
        cached = rnd.usage.cached_tokens
    else:
        prompt = len(json.dumps(body.get("messages", []))) // 4 + 1
        chars = len(rnd.text) + len(rnd.reasoning)
        completion = (chars + sum(len(c.arguments_json()) for c in rnd.tool_calls)) // 4 + 1
    cap = body.get("max_completion_tokens")
    if isinstance(cap, int) and cap >= 0:
        completion = min(completion, cap)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


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


class _Answer:
    """The answer to one chat completion request, played on its connection."""

    def __init__(
        self,
        owner: ScriptedOpenAIServer,
        conn: Conn,
        plan: _Plan,
        body: Any,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.owner = owner
        self.conn = conn
        self.plan = plan
        self.body: Mapping[str, Any] = body
        self.headers = dict(headers or {})
        """The rate-limit headers of the answer."""

    async def complete(self) -> bool:
        plan, rnd = self.plan, self.plan.round
        if plan.fault in ("silent_after_200", "silent_after_chunks", "keepalive_only"):
            await self._hold(keepalive=False)
        if plan.fault == "disconnect":
            self.conn.cut()
            return False
        if plan.fault == "malformed":
            await self.conn.respond(200, b"{not json", _JSON)
            return True
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
            "usage": _usage(rnd, self.body),
        }
        return await _json(self.conn, 200, completion, self.headers)

    async def stream(self) -> bool:
        """Stream the round; False when a fault left the body unfinished."""
        # Counted before the headers go out, so a client holding the response sees it.
        self.owner._count_stream(+1)
        try:
            await self.conn.start_chunked(200, {**_SSE, **self.headers})
            return await self._stream_body()
        finally:
            self.owner._count_stream(-1)

    async def _stream_body(self) -> bool:
        plan, rnd, body = self.plan, self.plan.round, self.body
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": plan.model,
        }
        if rnd.raw_chunks is not None:
            for raw in rnd.raw_chunks:
                await self._event(raw)
            await self.conn.end_chunked(b"data: [DONE]\n\n")
            return True
        # The chunk's fixed fields encoded once: a thousand streams made the server's JSON
        # encoding the bench's busiest code. The bytes are json.dumps({**base, "choices": ...}).
        head = json.dumps(base)[:-1] + ', "choices": ['
        fault_at = 0 if plan.fault == "silent_after_200" else rnd.fault_after_chunks
        delay_s = rnd.chunk_delay_ms / 1000
        clock = asyncio.get_running_loop().time
        started = clock()
        sent = 0
        for delta, finish in _deltas(plan):
            if sent == fault_at and await self._fault():
                return False
            if sent and delay_s:
                # On a fixed schedule, as a model makes tokens at its own pace: a chunk this
                # busy server sends late does not push back the ones after it.
                await asyncio.sleep(max(0.0, started + sent * delay_s - clock()))
            if sent == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            await self._event(f"{head}{json.dumps(choice)}]}}")
            sent += 1
        if sent <= fault_at and await self._fault():
            return False
        options = body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage") and not rnd.omit_usage:
            await self._event(json.dumps({**base, "choices": [], "usage": _usage(rnd, body)}))
        await self.conn.end_chunked(b"data: [DONE]\n\n")
        return True

    async def _fault(self) -> bool:
        """Play a mid-stream fault; True when the stream must end here."""
        fault = self.plan.fault
        if fault in ("silent_after_200", "silent_after_chunks"):
            await self._hold(keepalive=False)
        if fault == "keepalive_only":
            await self._hold(keepalive=True)
        if fault == "disconnect":
            # No terminating chunk: the client sees the body cut short.
            self.conn.cut()
            return True
        if fault == "malformed":
            await self._event("{not json")
            self.plan.fault = None
        return False

    async def _event(self, data: str) -> None:
        await self.conn.send_chunk(f"data: {data}\n\n".encode())

    async def _hold(self, *, keepalive: bool) -> NoReturn:
        """Send no data (SSE comments at most) until the client leaves; stop() cancels us."""
        while True:
            if keepalive:
                await self.conn.send_chunk(b": keep-alive\n\n")
            if await self.conn.wait_gone(_KEEPALIVE_S if keepalive else None):
                raise ClientGone


async def _json(
    conn: Conn, status: int, payload: object, headers: Mapping[str, str] | None = None
) -> bool:
    await conn.respond(status, json.dumps(payload).encode(), {**_JSON, **(headers or {})})
    return True


async def _error(
    conn: Conn,
    status: int,
    kind: str,
    message: str,
    retry_after_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> bool:
    headers = {**_JSON, **(headers or {})}
    if retry_after_s is not None:
        headers["retry-after-ms"] = str(int(retry_after_s * 1000))
        headers["Retry-After"] = str(max(1, int(-(-retry_after_s // 1))))
    await conn.respond(status, error_body(kind, message), headers)
    return True


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
    parser.add_argument("--requests-per-s", type=float, help="admit at most this many a second")
    parser.add_argument("--tokens-per-s", type=float, help="admit at most this many tokens")
    parser.add_argument("--limiter", choices=sorted(SHAPES), default="window", help="its shape")
    parser.add_argument("--overloaded-every", type=int, help="answer every Nth request 503")
    args = parser.parse_args(argv)

    scripts: dict[str, list[Round]] = {}
    if args.script == "demo":
        scripts[DEFAULT_KEY] = demo_rounds()
        from agentq.testing.agents import demo_scripts

        scripts.update(_SCRIPTS.validate_python(demo_scripts()))
    if args.script_file:
        scripts.update(_load_script_file(args.script_file))

    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    limits = ProviderLimits(
        requests_per_s=args.requests_per_s,
        tokens_per_s=args.tokens_per_s,
        overloaded_every=args.overloaded_every,
    )
    limits.set_shape(args.limiter)
    with ScriptedOpenAIServer(scripts, host=args.host, port=args.port, limits=limits) as server:
        print(f"listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
