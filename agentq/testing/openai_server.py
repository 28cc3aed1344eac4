"""A real OpenAI-compatible HTTP server that answers from scripts.

Tests point the real `openai` SDK at it to exercise streaming, stalls, HTTP errors
and malformed chunks over real sockets; `agentq dev` uses `demo_rounds()` when no
model is configured.

The round to answer is chosen from the request alone (the number of assistant
messages already in `messages`), and the script from the first user message, so
any number of concurrent conversations can share one server. It serves them with uvicorn
on one asyncio loop in one thread (`agentq.testing.serving`) over keep-alive connections,
so a thousand slow streams cost sockets, not threads; it needs the `local` extra (or the
`gateway` one, which has uvicorn and starlette too).

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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, Protocol

from agentq.fleet.lifecycle import Started
from agentq.testing.responses_answer import (
    RESPONSES_ROUTE,
    ResponsesAnswer,
    chat_tools_refusal,
    hold,
    input_messages,
    input_problem,
    usage_of,
)
from agentq.testing.scripts import (
    DEFAULT_KEY,
    SCRIPTS,
    Fault,
    Plan,
    Round,
    Script,
    ScriptedCall,
    demo_rounds,
    first_user_text,
    pieces,
    round_index,
    script_key,
    system_text,
    usage_counts,
)
from agentq.testing.serving import ClientGone, Conn, Request, ThreadedServer, error_body

__all__ = [
    "DEFAULT_KEY",
    "Fault",
    "RateLimit",
    "Round",
    "Script",
    "ScriptedCall",
    "ScriptedOpenAIServer",
    "demo_rounds",
    "first_user_text",
    "main",
    "round_index",
    "script_key",
    "system_text",
    "Verdict",
]

_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_HTTP_FAULTS: dict[str, tuple[int, str, str]] = {
    "http_500": (500, "server_error", "scripted fault: internal server error"),
    "http_429": (429, "rate_limit_exceeded", "scripted fault: rate limit reached"),
    "http_400": (400, "invalid_request_error", "scripted fault: invalid request"),
}


@dataclass(frozen=True)
class Verdict:
    """A rate limit's answer to one request: 200 admits it, with `headers` on the answer;
    another status refuses it, OpenAI's error of `kind` with `message`."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    kind: str = ""
    message: str = ""


class RateLimit(Protocol):
    """A provider's limits, which a test supplies: asked about every model request."""

    def check(self, now_s: float, tokens: int) -> Verdict:
        """The verdict on a request of about `tokens` tokens arriving at `now_s` (epoch)."""
        ...

    def reset(self) -> None:
        """Forget what was counted (ScriptedOpenAIServer.reset)."""
        ...


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
        rate_limit: RateLimit | None = None,
        api_key: str | None = None,
        refuse_chat_tools: bool = False,
        responses_api: bool = True,
        close_connections: bool = False,
        keep_requests: bool = True,
    ) -> None:
        self.keep_requests = keep_requests
        """Keep each request's body in `requests`, for a test to read. The command line's
        server keeps none: nothing can read them there, and they would only grow."""
        self.refuse_chat_tools = refuse_chat_tools
        """Play a reasoning model that refuses function tools on Chat Completions (400)."""
        self.responses_api = responses_api
        """Serve `POST /v1/responses`; False: 404, as an older compatible server."""
        self.rate_limit = rate_limit
        """The provider's rate limits and overloaded answers (None: every request admitted)."""
        self.close_connections = close_connections
        """Close the connection after every answer (`Connection: close`), as some proxies
        do; `Round.close_connection` does it for one round."""
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
        self._http: ThreadedServer | None = None

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
        if self.rate_limit is not None:
            self.rate_limit.reset()

    def start(self) -> ScriptedOpenAIServer:
        if self._http is not None:
            return self
        http = ThreadedServer(
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
        if not self.keep_requests:
            return
        with self._lock:
            self.requests.append(body)

    def _count_stream(self, delta: int) -> None:
        with self._lock:
            self._open_streams += delta

    def _client_gone(self) -> None:
        with self._lock:
            self._closed_by_client += 1

    def _plan(self, messages: list[Any], body: Mapping[str, Any]) -> Plan:
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
        return Plan(rnd, index, rnd.fault if applies else None, str(model or self.model))

    async def _answer(self, conn: Conn, request: Request) -> None:
        """Answer one request on the server's loop."""
        conn.close = self.close_connections
        try:
            await self._route(conn, request)
        except ClientGone:
            self._client_gone()
            raise

    async def _route(self, conn: Conn, request: Request) -> None:
        path, method = request.scope["path"], request.method
        route = path.rstrip("/")
        if method == "GET":
            if route == "/v1/models":
                data = [{"id": self.model, "object": "model", "created": 0, "owned_by": "agentq"}]
                return await _json(conn, 200, {"object": "list", "data": data})
            return await _error(conn, 404, "not_found", f"no route GET {path}")
        if method != "POST":
            return await _error(conn, 405, "method_not_allowed", f"{method} not served")
        chat = route == "/v1/chat/completions"
        if not chat and (route != RESPONSES_ROUTE or not self.responses_api):
            return await _error(conn, 404, "not_found", f"no route POST {path}")
        key = self.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            return await _error(conn, 401, "invalid_api_key", "Incorrect API key provided")
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            msg = f"request body is not JSON: {exc}"
            return await _error(conn, 400, "invalid_request_error", msg)
        if not isinstance(body, dict):
            return await _error(conn, 400, "invalid_request_error", "the body must be an object")
        problem = _chat_problem(body) if chat else input_problem(body)
        if problem is not None:
            return await _error(conn, 400, "invalid_request_error", problem)
        self._record(body)
        if chat and body.get("tools") and self.refuse_chat_tools:
            refusal = chat_tools_refusal(str(body.get("model") or self.model))
            return await _error(conn, 400, "invalid_request_error", refusal)
        plan = self._plan(body["messages"] if chat else input_messages(body), body)
        conn.close = conn.close or plan.round.close_connection
        headers: Mapping[str, str] = {}
        if self.rate_limit is not None:
            usage = _usage(plan.round, body) if chat else usage_of(plan.round, body)
            verdict = self.rate_limit.check(time.time(), usage["total_tokens"])
            if verdict.status != 200:
                status, kind, message = verdict.status, verdict.kind, verdict.message
                return await _error(conn, status, kind, message, headers=verdict.headers)
            headers = verdict.headers
        if plan.fault in _HTTP_FAULTS:
            status, kind, message = _HTTP_FAULTS[plan.fault]
            rnd = plan.round
            return await _error(conn, status, kind, rnd.fault_message or message, rnd.retry_after_s)
        answer = (
            _Answer(conn, plan, body, headers)
            if chat
            else ResponsesAnswer(conn, plan, body, headers)
        )
        if not body.get("stream"):
            return await answer.complete()
        # Counted before the headers go out, so a client holding the response sees it.
        self._count_stream(+1)
        try:
            await answer.stream()
        finally:
            self._count_stream(-1)


def _chat_problem(body: Mapping[str, Any]) -> str | None:
    """Why a chat request is malformed, or None."""
    return None if isinstance(body.get("messages"), list) else "'messages' must be a list"


def _usage(rnd: Round, body: Mapping[str, Any]) -> dict[str, Any]:
    """The round's usage as Chat Completions reports it."""
    prompt_chars = len(json.dumps(body.get("messages", [])))
    cap = body.get("max_completion_tokens")
    prompt, completion, cached, reasoning = usage_counts(rnd, prompt_chars, cap)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def _call(plan: Plan, position: int, call: ScriptedCall, arguments: str) -> dict[str, Any]:
    call_id = call.id or f"call_r{plan.index}_{position}"
    function = {"name": call.name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}


def _deltas(plan: Plan) -> Iterator[tuple[dict[str, Any], str | None]]:
    """(delta, finish_reason) of every choice chunk, in the order OpenAI sends them."""
    rnd = plan.round
    for piece in pieces(rnd.reasoning, rnd.chunk_size):
        yield {"reasoning_content": piece}, None
    for piece in pieces(rnd.text, rnd.chunk_size):
        yield {"content": piece}, None
    for position, call in enumerate(rnd.tool_calls):
        yield {"tool_calls": [{"index": position, **_call(plan, position, call, "")}]}, None
        for piece in pieces(call.arguments_json(), rnd.chunk_size):
            yield {"tool_calls": [{"index": position, "function": {"arguments": piece}}]}, None
    finish = "length" if plan.fault == "incomplete" else "stop"
    yield {}, "tool_calls" if rnd.tool_calls else finish


class _Answer:
    """The answer to one chat completion request, played on its connection."""

    def __init__(
        self,
        conn: Conn,
        plan: Plan,
        body: Any,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.conn = conn
        self.plan = plan
        self.body: Mapping[str, Any] = body
        self.headers = dict(headers or {})
        """The rate-limit headers of the answer."""

    async def complete(self) -> None:
        plan, rnd = self.plan, self.plan.round
        if plan.fault in ("silent_after_200", "silent_after_chunks", "keepalive_only"):
            await self._hold(keepalive=False)
        if plan.fault == "disconnect":
            return await self.conn.cut()
        if plan.fault == "malformed":
            return await self.conn.respond(200, b"{not json", _JSON)
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

    async def stream(self) -> None:
        """Stream the round, or as much of it as its fault lets through."""
        await self.conn.start_chunked(200, {**_SSE, **self.headers})
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
            return await self.conn.end_chunked(b"data: [DONE]\n\n")
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
                return
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
            return
        options = body.get("stream_options")
        if isinstance(options, Mapping) and options.get("include_usage") and not rnd.omit_usage:
            await self._event(json.dumps({**base, "choices": [], "usage": _usage(rnd, body)}))
        await self.conn.end_chunked(b"data: [DONE]\n\n")

    async def _fault(self) -> bool:
        """Play a mid-stream fault; True when the stream must end here."""
        fault = self.plan.fault
        if fault in ("silent_after_200", "silent_after_chunks"):
            await self._hold(keepalive=False)
        if fault == "keepalive_only":
            await self._hold(keepalive=True)
        if fault == "disconnect":
            # No terminating chunk: the client sees the body cut short.
            await self.conn.cut()
            return True
        if fault == "malformed":
            await self._event("{not json")
            self.plan.fault = None
        if fault == "failed":
            message = self.plan.round.fault_message or "scripted fault: the model failed"
            await self._event(json.dumps({"error": {"message": message, "type": "server_error"}}))
            await self.conn.end_chunked(b"data: [DONE]\n\n")
            return True
        return False

    async def _event(self, data: str) -> None:
        await self.conn.send_chunk(f"data: {data}\n\n".encode())

    async def _hold(self, *, keepalive: bool) -> NoReturn:
        await hold(self.conn, keepalive=keepalive)


async def _json(
    conn: Conn, status: int, payload: object, headers: Mapping[str, str] | None = None
) -> None:
    await conn.respond(status, json.dumps(payload).encode(), {**_JSON, **(headers or {})})


async def _error(
    conn: Conn,
    status: int,
    kind: str,
    message: str,
    retry_after_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    headers = {**_JSON, **(headers or {})}
    if retry_after_s is not None:
        headers["retry-after-ms"] = str(int(retry_after_s * 1000))
        headers["Retry-After"] = str(max(1, int(-(-retry_after_s // 1))))
    await conn.respond(status, error_body(kind, message), headers)


def _load_script_file(path: str) -> dict[str, Script]:
    return SCRIPTS.validate_json(Path(path).read_bytes())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentq.testing.openai_server",
        description="Serve a scripted OpenAI-compatible model.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", choices=["demo", "none"], default="demo")
    parser.add_argument("--script-file", help='JSON: {"key": [round, ...]}')
    parser.add_argument(
        "--close-connections",
        action="store_true",
        help="close the connection after every answer, as some proxies do",
    )
    args = parser.parse_args(argv)

    scripts: dict[str, list[Round]] = {}
    if args.script == "demo":
        scripts[DEFAULT_KEY] = demo_rounds()
        from agentq.testing.agents import demo_scripts

        scripts.update(SCRIPTS.validate_python(demo_scripts()))
    if args.script_file:
        scripts.update(_load_script_file(args.script_file))

    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server = ScriptedOpenAIServer(
        scripts,
        host=args.host,
        port=args.port,
        close_connections=args.close_connections,
        keep_requests=False,
    )
    with server:
        print(f"listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
