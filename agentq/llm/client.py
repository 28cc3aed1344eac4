"""One model round: stream a chat completion from an OpenAI-compatible server.

Synchronous on purpose: it runs inside a Celery threads-pool task. Each attempt gets
its own HTTP client, so the watchdog can cut exactly that attempt's sockets, and
every response, client and helper thread is closed before the attempt returns.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import httpx2
import openai
import pydantic

from agentq.errors import (
    Aborted,
    LlmError,
    MalformedStreamChunk,
    ModelBusy,
    ModelConnectionError,
    ModelHTTPError,
    StreamDurationExceeded,
)
from agentq.llm.headers import BUSY_STATUSES, parse_retry_after, rate_headers
from agentq.llm.retry import backoff_s, retryable_status, should_retry
from agentq.llm.transport import SocketTracker, tracked_http_client
from agentq.llm.watchdog import POLL_S, StreamWatchdog
from agentq.models import AssistantMessage, ToolCall, Usage

DeltaCallback = Callable[[str, str], None]
"""(kind, text): kind is "text" or "reasoning"."""
RetryCallback = Callable[[int, Exception, float], None]
"""(attempt that failed, its error, delay before the retry in seconds)."""

Tools = list[dict[str, Any]] | str
"""Tool schemas: a list, or the JSON array text of one (the stream worker's form)."""


# The transport's own read timeout is only a backstop behind the watchdog, so it
# must never fire first.
_READ_BACKSTOP_MARGIN_S = 1.0


def stream_round(
    messages: list[dict[str, Any]],
    tools: Tools,
    *,
    base_url: str,
    api_key: str | None,
    model: str,
    idle_timeout_ms: int,
    duration_left_s: float,
    max_retries: int,
    request_timeout_s: float,
    on_delta: DeltaCallback,
    on_retry: RetryCallback,
    cancelled: Callable[[], bool],
    turn_id: str = "",
    duration_limit_s: float | None = None,
) -> tuple[AssistantMessage, float]:
    """Stream one assistant message; returns it and the seconds spent streaming.

    Retries follow `agentq.llm.retry`; `on_retry` is called before each backoff
    sleep, which `cancelled()` interrupts. Each attempt may stream for at most
    `duration_left_s` (checked between chunks); `duration_limit_s`, the configured
    stream_duration_s, only makes the error report the whole budget. The seconds
    returned include failed attempts but not backoff sleeps.

    Raises Aborted, StreamIdleTimeout, StreamDurationExceeded, ModelHTTPError
    (status 0 when the server could not be reached) or MalformedStreamChunk.
    """
    limit_s = duration_limit_s if duration_limit_s is not None else duration_left_s
    streamed_s = 0.0
    attempt = 0
    while True:
        attempt += 1
        if cancelled():
            raise Aborted(turn_id)
        if duration_left_s <= 0:
            raise StreamDurationExceeded(limit_s, limit_s - duration_left_s)
        run = _Attempt(
            base_url=base_url,
            api_key=api_key,
            model=model,
            idle_timeout_ms=idle_timeout_ms,
            request_timeout_s=request_timeout_s,
            duration_left_s=duration_left_s,
            duration_limit_s=limit_s,
            on_delta=on_delta,
            cancelled=cancelled,
            turn_id=turn_id,
        )
        try:
            message = run.run(messages, tools)
        except LlmError as exc:
            streamed_s += run.elapsed_s
            error = exc
        else:
            return message, streamed_s + run.elapsed_s
        if cancelled():
            raise Aborted(turn_id) from error
        retry = should_retry(
            error, chunks_received=run.chunks_received, attempt=attempt, max_retries=max_retries
        )
        if not retry:
            raise error
        delay_s = backoff_s(attempt, run.retry_after_s)
        on_retry(attempt, error, delay_s)
        _sleep(delay_s, cancelled, turn_id)


def _sleep(delay_s: float, cancelled: Callable[[], bool], turn_id: str) -> None:
    deadline = time.monotonic() + delay_s
    while True:
        if cancelled():
            raise Aborted(turn_id)
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return
        time.sleep(min(POLL_S, left_s))


def api_error_to_llm(exc: openai.APIError) -> ModelHTTPError:
    """The agentq error for an SDK error, with the server's own message."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body
        message = exc.message
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            message = body["message"]
        if exc.status_code in BUSY_STATUSES:
            headers = exc.response.headers
            return ModelBusy(
                exc.status_code, message, parse_retry_after(headers), rate_headers(headers)
            )
        return ModelHTTPError(exc.status_code, message, retryable_status(exc.status_code))
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
        return ModelConnectionError(detail)
    # An error event inside a 200 stream.
    return ModelHTTPError(200, f"error in the stream: {exc.message}", False)


class _Attempt:
    """One request; records what the retry decision needs."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        model: str,
        idle_timeout_ms: int,
        request_timeout_s: float,
        duration_left_s: float,
        duration_limit_s: float,
        on_delta: DeltaCallback,
        cancelled: Callable[[], bool],
        turn_id: str,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.model = model
        self.idle_timeout_ms = idle_timeout_ms
        self.request_timeout_s = request_timeout_s
        self.duration_left_s = duration_left_s
        self.duration_limit_s = duration_limit_s
        self.on_delta = on_delta
        self.cancelled = cancelled
        self.turn_id = turn_id
        self.chunks_received = 0
        self.retry_after_s: float | None = None
        self.elapsed_s = 0.0
        self._started = time.monotonic()

    def _timeout(self) -> httpx2.Timeout:
        read_s = self.request_timeout_s
        if self.idle_timeout_ms > 0:
            read_s = max(read_s, self.idle_timeout_ms / 1000.0 + _READ_BACKSTOP_MARGIN_S)
        return httpx2.Timeout(self.request_timeout_s, read=read_s)

    def run(self, messages: list[dict[str, Any]], tools: Tools) -> AssistantMessage:
        tracker = SocketTracker()
        watchdog = StreamWatchdog(
            idle_timeout_ms=self.idle_timeout_ms,
            cancelled=self.cancelled,
            interrupt=tracker.shutdown_all,
            turn_id=self.turn_id,
        )
        self._started = time.monotonic()
        try:
            with (
                tracked_http_client(tracker, self._timeout()) as http,
                openai.OpenAI(
                    base_url=self.base_url,
                    api_key=self.api_key or "unused",
                    max_retries=0,
                    timeout=self._timeout(),
                    http_client=http,
                ) as client,
                watchdog,
            ):
                message = self._stream(client, tracker, watchdog, messages, tools)
            # The helper thread is joined now, so a trip at the very end is seen.
            watchdog.raise_if_tripped()
            return message
        finally:
            self.elapsed_s = time.monotonic() - self._started
            self.chunks_received = watchdog.chunks_received

    def _stream(
        self,
        client: openai.OpenAI,
        tracker: SocketTracker,
        watchdog: StreamWatchdog,
        messages: list[dict[str, Any]],
        tools: Tools,
    ) -> AssistantMessage:
        try:
            stream = client.post(
                CHAT_COMPLETIONS_PATH,
                content=chat_request(self.model, messages, tools),
                cast_to=object,
                stream=True,
                stream_cls=openai.Stream[object],
            )
        except openai.APIError as exc:
            self._fail(watchdog, exc)
        with stream:
            tracker.add_response(stream.response)
            assembler = _Assembler(self.on_delta)
            while True:
                try:
                    chunk = next(stream)
                except StopIteration:
                    break
                except (openai.APIError, ValueError) as exc:
                    self._fail(watchdog, exc)
                watchdog.chunk()
                watchdog.raise_if_tripped()
                self._check_duration()
                assembler.add(chunk, watchdog.chunks_received - 1)
                watchdog.touch()
        return assembler.message()

    def _check_duration(self) -> None:
        elapsed_s = time.monotonic() - self._started
        if elapsed_s > self.duration_left_s:
            used_s = self.duration_limit_s - self.duration_left_s
            raise StreamDurationExceeded(self.duration_limit_s, used_s + elapsed_s)

    def _fail(self, watchdog: StreamWatchdog, exc: Exception) -> NoReturn:
        """Raise the error behind `exc`: a watchdog trip explains a cut connection."""
        tripped = watchdog.error()
        if tripped is not None:
            raise tripped from None
        if isinstance(exc, openai.APIError):
            if isinstance(exc, openai.APIStatusError):
                self.retry_after_s = parse_retry_after(exc.response.headers)
            raise api_error_to_llm(exc) from exc
        problem = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else "undecodable"
        raise MalformedStreamChunk(watchdog.chunks_received, f"{problem}: {exc}") from exc


CHAT_COMPLETIONS_PATH = "/chat/completions"


def chat_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: Tools,
    max_completion_tokens: int | None = None,
) -> bytes:
    """The streamed chat-completions request body, encoded.

    Sent through the SDK's own `post` (its auth, errors and transport) as its `content`,
    which it sends as it is: the turn's history and the tool schemas are JSON already, and the
    per-request transform of `chat.completions.create` cost a busy stream worker a fifth
    of its CPU. A stream worker gets the schemas as the text the turn encoded once per
    tool set and splices them in unparsed. Chunks come back as plain dicts for the same
    reason (the SDK's model construction cost as much).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_completion_tokens is not None:
        # What the turn's and its key's budgets leave this round (docs/spend.md).
        body["max_completion_tokens"] = max_completion_tokens
    text = json.dumps(body, separators=(",", ":"))
    schemas = tools if isinstance(tools, str) else json.dumps(tools, separators=(",", ":"))
    if schemas.strip() not in ("", "[]"):
        text = text[:-1] + ',"tools":' + schemas + "}"
    return text.encode()


def _field(obj: object, name: str) -> Any:
    """A chunk's field, whether the chunk is a dict (raw JSON) or an SDK object."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


@dataclass
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class _Assembler:
    """Builds the assistant message from chunk deltas, checking their shape."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        self._on_delta = on_delta
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, _PartialCall] = {}
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._last_index = -1

    def add(self, chunk: object, index: int) -> None:
        self._last_index = index
        choices = _field(chunk, "choices")
        usage = _field(chunk, "usage")
        if choices is None and usage is None:
            _bad(index, "chunk has neither 'choices' nor 'usage'")
        if choices is not None and not isinstance(choices, list):
            _bad(index, "'choices' is not a list")
        if usage is not None:
            self._usage = _usage(usage, index)
        for choice in choices or ():
            # Only one choice is ever requested; others would belong to n > 1.
            if (_field(choice, "index") or 0) == 0:
                self._add_choice(choice, index)

    def _add_choice(self, choice: object, index: int) -> None:
        finish = _opt_str(choice, "finish_reason", index)
        if finish is not None:
            self._finish_reason = finish
        delta = _field(choice, "delta")
        if delta is None:
            return
        if not isinstance(delta, (dict, pydantic.BaseModel)):
            _bad(index, "'delta' is not an object")
        reasoning = _opt_str(delta, "reasoning_content", index) or _opt_str(
            delta, "reasoning", index
        )
        if reasoning:
            self._reasoning.append(reasoning)
            self._on_delta("reasoning", reasoning)
        text = _opt_str(delta, "content", index)
        if text:
            self._text.append(text)
            self._on_delta("text", text)
        calls = _field(delta, "tool_calls")
        if calls is None:
            return
        if not isinstance(calls, list):
            _bad(index, "'tool_calls' is not a list")
        for call in calls:
            self._add_call(call, index)

    def _add_call(self, call: object, index: int) -> None:
        position = _field(call, "index")
        if not isinstance(position, int):
            _bad(index, "tool call delta without an integer 'index'")
        partial = self._calls.setdefault(position, _PartialCall())
        call_id = _opt_str(call, "id", index)
        if call_id and not partial.id:
            partial.id = call_id
        function = _field(call, "function")
        if function is None:
            return
        name = _opt_str(function, "name", index)
        if name and not partial.name:
            partial.name = name
        arguments = _opt_str(function, "arguments", index)
        if arguments:
            partial.arguments.append(arguments)

    @property
    def has_output(self) -> bool:
        """Whether the model said anything yet: text, reasoning or a tool call."""
        return bool(self._text or self._reasoning or self._calls)

    def message(self) -> AssistantMessage:
        calls: list[ToolCall] = []
        for position in sorted(self._calls):
            partial = self._calls[position]
            if not partial.name:
                _bad(self._last_index, f"tool call at index {position} has no function name")
            calls.append(
                ToolCall(
                    id=partial.id or f"call_{uuid.uuid4().hex[:24]}",
                    name=partial.name,
                    arguments="".join(partial.arguments) or "{}",
                )
            )
        return AssistantMessage(
            content="".join(self._text),
            reasoning="".join(self._reasoning),
            tool_calls=tuple(calls),
            finish_reason=self._finish_reason,
            usage=self._usage,
        )


def _bad(index: int, detail: str) -> NoReturn:
    raise MalformedStreamChunk(index, detail)


def _opt_str(obj: object, name: str, index: int) -> str | None:
    value = _field(obj, name)
    if value is not None and not isinstance(value, str):
        _bad(index, f"'{name}' is not a string")
    return value


def _usage(usage: object, index: int) -> Usage:
    counts: dict[str, int] = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = _field(usage, name) or 0
        if not isinstance(value, int):
            _bad(index, f"usage '{name}' is not an integer")
        counts[name] = value
    details = _field(usage, "prompt_tokens_details")
    cached = (_field(details, "cached_tokens") if details is not None else None) or 0
    if not isinstance(cached, int):
        _bad(index, "usage 'prompt_tokens_details.cached_tokens' is not an integer")
    return Usage(
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        total_tokens=counts["total_tokens"],
        cached_tokens=cached,
    )
