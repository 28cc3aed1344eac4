"""One model round on the event loop: the async twin of `agentq.llm.client.stream_round`.

The same rules (`agentq.llm.retry`), the same inactivity watchdog semantics, the same
stream-duration budget; one shared AsyncOpenAI client per process, so a stream worker
holds thousands of streams with one loop and one connection pool. The watchdog is
not a thread here: the attempt's reading task is cancelled on silence or abort, which
closes that response's connection. An abort arrives as `abort` (an asyncio.Event the
cancel channel sets) and always wins over the silence limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import ssl
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import anyio
import httpx2
import openai
from openai._models import FinalRequestOptions

from agentq.errors import (
    Aborted,
    LlmError,
    MalformedStreamChunk,
    ModelBusy,
    StreamDurationExceeded,
    StreamIdleTimeout,
)
from agentq.llm.client import (
    CHAT_COMPLETIONS_PATH,
    DeltaCallback,
    Tools,
    _Assembler,
    api_error_to_llm,
    chat_request,
)
from agentq.llm.headers import parse_retry_after, rate_headers
from agentq.llm.retry import backoff_s, classify, should_retry
from agentq.llm.sse import SseLines, chunk_of
from agentq.models import AssistantMessage

log = logging.getLogger("agentq.llm")

RetryCallback = Callable[[int, Exception, float], None]
_READ_ERRORS = (httpx2.RequestError, ssl.SSLError, anyio.EndOfStream)
"""What reading a body raises when its connection fails: the SDK's stream calls them a
connection error (`openai.APIConnectionError`), and so does this one."""


def _caused(error: openai.APIError, cause: Exception) -> openai.APIError:
    error.__cause__ = cause
    return error


def client_timeout(request_timeout_s: float, idle_timeout_ms: int) -> httpx2.Timeout:
    """No read timeout while the watchdog is on: it owns silence, before the answer's
    headers as after them, and on the aiohttp transport a read timeout is a timer
    cancelled and set again for every chunk of every stream (a tenth of a busy stream
    worker's CPU). With the watchdog off the request timeout bounds each read."""
    return httpx2.Timeout(
        request_timeout_s, read=None if idle_timeout_ms > 0 else request_timeout_s
    )


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    """A client's chat-completions request as the SDK builds it: URL, auth and headers."""

    url: httpx2.URL
    headers: list[tuple[str, str]]
    timeout: dict[str, float | None]


_endpoints: weakref.WeakKeyDictionary[openai.AsyncOpenAI, _Endpoint] = weakref.WeakKeyDictionary()


async def _endpoint(client: openai.AsyncOpenAI) -> _Endpoint:
    """Built once per client by the SDK, and sent by its HTTP client per round: the SDK's
    per-request building (options copied and validated, headers merged, the URL parsed
    again) cost a busy stream worker another tenth of its CPU. agentq's clients carry a
    static key (`make_client`), so the request is the same every round."""
    found = _endpoints.get(client)
    if found is None:
        options = FinalRequestOptions.construct(method="post", url=CHAT_COMPLETIONS_PATH)
        built = client._build_request(await client._prepare_options(options))
        headers = [(k, v) for k, v in built.headers.multi_items() if k != "content-length"]
        found = _Endpoint(built.url, headers, dict(built.extensions["timeout"]))
        _endpoints[client] = found
    return found


@functools.cache
def _warn_no_aiohttp() -> None:
    """Once per process: a stream worker builds several clients."""
    log.warning("aiohttp is not installed: model streams use the slower httpx2 transport")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process, as each client would make it (SSL_CERT_FILE honoured):
    loading the CA bundle costs tens of CPU ms, and a stream worker makes a client per
    128 streams of its capacity, which made every start load it eight times."""
    return httpx2.create_ssl_context(verify=True, trust_env=True)


def make_client(
    *, base_url: str, api_key: str | None, max_connections: int, timeout: httpx2.Timeout
) -> openai.AsyncOpenAI:
    limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=200)
    tls = _tls_context()
    http: httpx2.AsyncClient
    try:
        # The SDK's aiohttp transport (the `openai[aiohttp]` extra): a thousand rounds at
        # once cost 2.7 CPU ms each on it and 4.8 on httpx2, whose HTTP/1.1 parser and
        # connection pool are pure Python (scripts/bench_stream_client.py).
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
    client: openai.AsyncOpenAI,
    messages: list[dict[str, Any]],
    tools: Tools,
    *,
    model: str,
    idle_timeout_ms: int,
    duration_left_s: float,
    max_retries: int,
    timeout: httpx2.Timeout | None,
    on_delta: DeltaCallback,
    on_retry: RetryCallback,
    abort: asyncio.Event,
    turn_id: str = "",
    duration_limit_s: float | None = None,
    on_first_output: Callable[[], None] | None = None,
    busy_is_final: bool = False,
    on_headers: Callable[[dict[str, str]], None] | None = None,
    failover: bool = False,
    max_completion_tokens: int | None = None,
) -> tuple[AssistantMessage, float]:
    """Stream one assistant message; returns it and the seconds spent streaming.

    `on_first_output` is called once per attempt, when the first chunk with text, reasoning
    or a tool call arrives (time to first token). `on_headers` gets the rate-limit headers
    of the answer that streams. With `busy_is_final`, a busy answer (429, 503, 529) ends
    the round with `ModelBusy` at once: the fleet's capacity manager waits, not this stream.
    With `failover` (the model has other deployments), a failure that a retry here would
    send to the same deployment again (a server error, a refused connection, a stall before
    any chunk) ends the round at once too, so the next attempt goes to a healthy one.

    Raises what `stream_round` raises, under the same rules.
    """
    limit_s = duration_limit_s if duration_limit_s is not None else duration_left_s
    streamed_s = 0.0
    attempt = 0
    while True:
        attempt += 1
        if abort.is_set():
            raise Aborted(turn_id)
        if duration_left_s <= 0:
            raise StreamDurationExceeded(limit_s, limit_s - duration_left_s)
        run = _Attempt(
            client=client,
            model=model,
            idle_timeout_ms=idle_timeout_ms,
            duration_left_s=duration_left_s,
            duration_limit_s=limit_s,
            timeout=timeout,
            on_delta=on_delta,
            abort=abort,
            turn_id=turn_id,
            on_first_output=on_first_output,
            on_headers=on_headers,
            max_completion_tokens=max_completion_tokens,
        )
        try:
            message = await run.run(messages, tools)
        except LlmError as exc:
            streamed_s += run.elapsed_s
            error = exc
        else:
            return message, streamed_s + run.elapsed_s
        if abort.is_set():
            raise Aborted(turn_id) from error
        if busy_is_final and isinstance(error, ModelBusy):
            raise error
        if failover and run.chunks == 0 and classify(error) in ("http_retryable", "idle_timeout"):
            raise error
        if not should_retry(
            error, chunks_received=run.chunks, attempt=attempt, max_retries=max_retries
        ):
            raise error
        delay_s = backoff_s(attempt, run.retry_after_s)
        on_retry(attempt, error, delay_s)
        try:
            await asyncio.wait_for(abort.wait(), delay_s)
        except asyncio.TimeoutError:
            continue
        raise Aborted(turn_id)


class _Attempt:
    def __init__(
        self,
        *,
        client: openai.AsyncOpenAI,
        model: str,
        idle_timeout_ms: int,
        duration_left_s: float,
        duration_limit_s: float,
        timeout: httpx2.Timeout | None,
        on_delta: DeltaCallback,
        abort: asyncio.Event,
        turn_id: str,
        on_first_output: Callable[[], None] | None = None,
        on_headers: Callable[[dict[str, str]], None] | None = None,
        max_completion_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.max_completion_tokens = max_completion_tokens
        self.on_first_output = on_first_output
        self.on_headers = on_headers
        self.model = model
        self.idle_timeout_ms = idle_timeout_ms
        self.idle_s = idle_timeout_ms / 1000.0 if idle_timeout_ms > 0 else None
        self.duration_left_s = duration_left_s
        self.duration_limit_s = duration_limit_s
        self.timeout = timeout
        self.on_delta = on_delta
        self.abort = abort
        self.turn_id = turn_id
        self.chunks = 0
        self.retry_after_s: float | None = None
        self.elapsed_s = 0.0
        self._started = time.monotonic()
        self._last = self._started

    async def run(self, messages: list[dict[str, Any]], tools: Tools) -> AssistantMessage:
        self._started = self._last = time.monotonic()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._stream(messages, tools))
        aborted = loop.create_task(self.abort.wait())
        trip: str | None = None
        try:
            while True:
                wait_s = (
                    None
                    if self.idle_s is None
                    else max(0.0, self._last + self.idle_s - time.monotonic())
                )
                done, _ = await asyncio.wait(
                    {reader, aborted}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                )
                if reader in done:
                    break
                if aborted in done:
                    trip = "abort"
                elif self.idle_s is not None and time.monotonic() - self._last >= self.idle_s:
                    # Abort wins: look at the flag again at the moment the limit fires.
                    trip = "abort" if self.abort.is_set() else "idle"
                if trip is not None:
                    lifetime_ms = int((time.monotonic() - self._started) * 1000)
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
                    if trip == "abort" or self.abort.is_set():
                        raise Aborted(self.turn_id)
                    raise StreamIdleTimeout(self.idle_timeout_ms, self.chunks, lifetime_ms)
            return reader.result()
        finally:
            aborted.cancel()
            if not reader.done():
                reader.cancel()
            self.elapsed_s = time.monotonic() - self._started

    async def _stream(self, messages: list[dict[str, Any]], tools: Tools) -> AssistantMessage:
        endpoint = await _endpoint(self.client)
        request = httpx2.Request(
            "POST",
            endpoint.url,
            headers=endpoint.headers,
            content=chat_request(self.model, messages, tools, self.max_completion_tokens),
            extensions={
                "timeout": endpoint.timeout if self.timeout is None else self.timeout.as_dict()
            },
        )
        try:
            response = await self.client._client.send(request, stream=True)
        except httpx2.TimeoutException as exc:
            self._fail(_caused(openai.APITimeoutError(request), exc))
        except Exception as exc:  # as the SDK's own request: any failure to send
            self._fail(_caused(openai.APIConnectionError(request=request), exc))
        try:
            if response.status_code >= 400:
                try:
                    await response.aread()
                except _READ_ERRORS as exc:
                    self._fail(_caused(openai.APIConnectionError(request=request), exc))
                self._fail(self.client._make_status_error_from_response(response))
            if self.on_headers is not None:
                self.on_headers(rate_headers(response.headers))
            # The body is read here, not through the SDK's stream (agentq.llm.sse); to the
            # end, [DONE] included, so the connection goes back to the pool.
            assembler = _Assembler(self.on_delta)
            lines = SseLines()
            body = response.aiter_bytes()
            while True:
                try:
                    raw = await body.__anext__()
                except StopAsyncIteration:
                    break
                except httpx2.TimeoutException as exc:
                    self._fail(_caused(openai.APITimeoutError(request), exc))
                except _READ_ERRORS as exc:
                    self._fail(_caused(openai.APIConnectionError(request=request), exc))
                for payload in lines.feed(raw):
                    try:
                        chunk = chunk_of(payload)
                    except ValueError as exc:
                        self._fail(exc)
                    self.chunks += 1
                    self._last = time.monotonic()
                    elapsed_s = self._last - self._started
                    if elapsed_s > self.duration_left_s:
                        used_s = self.duration_limit_s - self.duration_left_s
                        raise StreamDurationExceeded(self.duration_limit_s, used_s + elapsed_s)
                    assembler.add(chunk, self.chunks - 1)
                    if self.on_first_output is not None and assembler.has_output:
                        self.on_first_output()
                        self.on_first_output = None
                self._last = time.monotonic()
        finally:
            await response.aclose()
        return assembler.message()

    def _fail(self, exc: Exception) -> NoReturn:
        if isinstance(exc, openai.APIError):
            if isinstance(exc, openai.APIStatusError):
                self.retry_after_s = parse_retry_after(exc.response.headers)
            raise api_error_to_llm(exc) from exc
        problem = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else "undecodable"
        raise MalformedStreamChunk(self.chunks, f"{problem}: {exc}") from exc
