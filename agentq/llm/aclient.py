"""One model round on the event loop: retries, the inactivity watchdog and the duration
budget. The watchdog is no thread: the attempt's reading task is cancelled on silence or
abort (which always wins), and that closes the response's connection."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, NoReturn

import anyio
import httpx2
import openai

from agentq.errors import (
    Aborted,
    AgentqError,
    LlmError,
    ModelConnectionError,
    StreamDurationExceeded,
    StreamIdleTimeout,
)
from agentq.llm import sdk
from agentq.llm.client import (
    CHAT_COMPLETIONS_PATH,
    Assembler,
    ChatAssembler,
    DeltaCallback,
    api_error_to_llm,
    chat_request,
)
from agentq.llm.headers import parse_retry_after, rate_headers
from agentq.llm.responses import (
    RESPONSES_PATH,
    ModelApi,
    ResponsesAssembler,
    responses_request,
)
from agentq.llm.retry import backoff_s, should_retry
from agentq.llm.sse import SseLines, chunk_of
from agentq.models import AssistantMessage

log = logging.getLogger("agentq.llm")

RetryCallback = Callable[[int, Exception, float], None]
"""(attempt that failed, its error, delay before the retry in seconds)."""
_READ_ERRORS = (httpx2.RequestError, ssl.SSLError, anyio.EndOfStream)
"""What reading a body raises when its connection fails (the SDK's APIConnectionError)."""


def _lost(exc: Exception) -> NoReturn:
    """A request that could not be sent or read, in the SDK's words for it."""
    what = "Request timed out." if isinstance(exc, httpx2.TimeoutException) else "Connection error."
    raise ModelConnectionError(f"{what} ({type(exc).__name__}: {exc})") from exc


@functools.cache  # every round asks for its agent's: one Timeout per idle limit
def client_timeout(request_timeout_s: float, idle_timeout_ms: int) -> httpx2.Timeout:
    """No read timeout while the watchdog owns silence: on aiohttp a read timeout is a timer
    reset for every chunk (a tenth of a busy stream worker's CPU)."""
    return httpx2.Timeout(
        request_timeout_s, read=None if idle_timeout_ms > 0 else request_timeout_s
    )


@functools.cache
def _warn_no_aiohttp() -> None:
    """Once per process: a stream worker builds several clients."""
    log.warning("aiohttp is not installed: model streams use the slower httpx2 transport")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process (SSL_CERT_FILE honoured): loading the CA bundle costs
    tens of CPU ms, and a stream worker makes a client per 128 streams."""
    return httpx2.create_ssl_context(verify=True, trust_env=True)


def make_client(
    *, base_url: str, api_key: str | None, max_connections: int, timeout: httpx2.Timeout
) -> openai.AsyncOpenAI:
    sdk.check_sdk()
    limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=200)
    tls = _tls_context()
    http: httpx2.AsyncClient
    try:
        # `openai[aiohttp]`: a thousand rounds at once cost 2.7 CPU ms each on it and 4.8
        # on httpx2's pure-Python parser and pool (scripts/bench_stream_client.py).
        http = openai.DefaultAioHttpClient(timeout=timeout, limits=limits, verify=tls)
    except RuntimeError:
        _warn_no_aiohttp()
        http = openai.DefaultAsyncHttpxClient(timeout=timeout, limits=limits, verify=tls)
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key or "unused",
        max_retries=0,
        timeout=timeout,
        http_client=http,
    )


async def astream_round(
    first: Attempt, messages: list[dict[str, Any]], tools: str
) -> tuple[AssistantMessage, float]:
    """The assistant message and the seconds spent streaming it, each attempt a fresh copy
    of `first`; an `LlmError` once no retry is allowed, or `Aborted`."""
    abort, turn_id = first.abort, first.turn_id
    streamed_s = 0.0
    attempt = 0
    while True:
        attempt += 1
        if abort.is_set():
            raise Aborted(turn_id)
        # The round's retries share its duration budget: each gets what the last left.
        left_s = first.duration_left_s - streamed_s
        if left_s <= 0:
            raise StreamDurationExceeded(first.duration_left_s, streamed_s)
        run = dataclasses.replace(first, duration_left_s=left_s)
        try:
            return await run.run(messages, tools), streamed_s + run.elapsed_s
        except LlmError as exc:
            error = exc
        streamed_s += run.elapsed_s
        if abort.is_set():
            raise Aborted(turn_id) from error
        if not should_retry(
            error,
            chunks_received=run.said,
            attempt=attempt,
            max_retries=first.max_retries,
            failover=first.failover,
        ):
            raise error
        delay_s = backoff_s(attempt, run.retry_after_s)
        first.on_retry(attempt, error, delay_s)
        # An abort cuts the wait short: the loop's first check raises Aborted.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(abort.wait(), delay_s)


@dataclasses.dataclass
class Attempt:
    """How a round is sent (`astream_round`), and what one attempt of it found."""

    client: openai.AsyncOpenAI
    model: str
    idle_timeout_ms: int
    duration_left_s: float
    max_retries: int
    timeout: httpx2.Timeout
    """The request's timeouts (`client_timeout` of the round's idle limit)."""
    on_delta: DeltaCallback
    on_retry: RetryCallback
    abort: asyncio.Event
    turn_id: str = ""
    on_first_output: Callable[[], None] | None = None
    """Called once per attempt, at its first text, reasoning or tool call (time to first token)."""
    on_headers: Callable[[dict[str, str]], None] | None = None
    """Gets the streaming answer's rate-limit headers."""
    failover: bool = False
    max_completion_tokens: int | None = None
    api: ModelApi = "chat"
    output_format: dict[str, Any] | None = None
    """A typed answer's `text.format` (Responses API)."""
    # What one attempt found: not arguments, so each copy (`replace`) starts from nothing.
    assembler: Assembler | None = dataclasses.field(default=None, init=False)
    chunks: int = dataclasses.field(default=0, init=False)
    retry_after_s: float | None = dataclasses.field(default=None, init=False)
    elapsed_s: float = dataclasses.field(default=0.0, init=False)
    _last: float = dataclasses.field(default=0.0, init=False)

    @property
    def said(self) -> int:
        """Chunks whose deltas a retry would publish twice."""
        return getattr(self.assembler, "output_events", self.chunks)

    async def run(self, messages: list[dict[str, Any]], tools: str) -> AssistantMessage:
        started = self._last = time.monotonic()
        idle_s = self.idle_timeout_ms / 1000 if self.idle_timeout_ms > 0 else None
        # The budget is this clock's too: keep-alive comments must not outlive it.
        ends_at = started + self.duration_left_s
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._stream(messages, tools))
        aborted = loop.create_task(self.abort.wait())
        try:
            while True:
                due = ends_at if idle_s is None else min(ends_at, self._last + idle_s)
                done, _ = await asyncio.wait(
                    {reader, aborted},
                    timeout=max(0.0, due - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if reader in done:
                    return reader.result()
                now = time.monotonic()
                lifetime_s = now - started
                if aborted in done:
                    error: AgentqError = Aborted(self.turn_id)
                elif idle_s is not None and now - self._last >= idle_s:
                    error = StreamIdleTimeout(
                        self.idle_timeout_ms, self.said, int(lifetime_s * 1000)
                    )
                elif now >= ends_at:
                    error = StreamDurationExceeded(self.duration_left_s, lifetime_s)
                else:
                    continue
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
                # Abort wins: look at the flag again at the moment a limit fires.
                raise Aborted(self.turn_id) if self.abort.is_set() else error
        finally:
            aborted.cancel()
            reader.cancel()  # a no-op once it is done
            self.elapsed_s = time.monotonic() - started

    async def _stream(self, messages: list[dict[str, Any]], tools: str) -> AssistantMessage:
        if self.api == "responses":
            path = RESPONSES_PATH
            content = responses_request(
                self.model, messages, tools, self.max_completion_tokens, self.output_format
            )
        else:
            path = CHAT_COMPLETIONS_PATH
            content = chat_request(self.model, messages, tools, self.max_completion_tokens)
        endpoint = await sdk.endpoint(self.client, path)
        request = httpx2.Request(
            "POST",
            endpoint.url,
            headers=endpoint.headers,
            content=content,
            extensions={"timeout": self.timeout.as_dict()},
        )
        try:
            response = await sdk.send(self.client, request)
        except Exception as exc:  # as the SDK's own request: any failure to send
            _lost(exc)
        try:
            if response.status_code >= 400:
                await response.aread()
                self.retry_after_s = parse_retry_after(response.headers)
                error = sdk.status_error(self.client, response)
                raise api_error_to_llm(error) from error
            if self.on_headers is not None:
                self.on_headers(rate_headers(response.headers))
            # Read to the end, [DONE] included, so the connection goes back to the pool.
            kind = ResponsesAssembler if self.api == "responses" else ChatAssembler
            assembler = self.assembler = kind(self.on_delta)
            lines = SseLines()
            async for raw in response.aiter_bytes():
                for payload in lines.feed(raw):
                    chunk = chunk_of(payload, self.chunks)
                    # Only a parsed event is activity: comments, blank lines and partial
                    # lines never reach here, so keep-alives cannot hold the watchdog off.
                    self.chunks += 1
                    self._last = time.monotonic()
                    assembler.add(chunk, self.chunks - 1)
                    if self.on_first_output is not None and assembler.has_output:
                        self.on_first_output()
                        self.on_first_output = None
        except _READ_ERRORS as exc:  # nothing but reading the body raises these
            _lost(exc)
        finally:
            await response.aclose()
        return assembler.message(self.chunks - 1)
