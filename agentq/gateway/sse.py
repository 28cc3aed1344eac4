"""Server-sent events: a turn's log-then-live events as an ASGI response that notices disconnects.

Each SSE message is ``id: <cursor>`` (`events.follow.Cursor`, which a reconnecting
EventSource sends back as ``Last-Event-ID``), ``event: <type>``, ``data: <event JSON>``.
Blocking Redis reads run in worker threads with their own capacity limiter, so many open
streams cannot starve the REST handlers; the follow loop wakes at least every `poll_s`,
which is when a gone client is noticed and the loop stopped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from agentq.errors import REDIS_ERRORS
from agentq.events import Event

log = logging.getLogger("agentq.gateway.sse")

KEEP_ALIVE = b": keep-alive\n\n"
RETRY_MS = 1000
"""Reconnect delay we ask EventSource for."""


def format_event(ev: Event) -> bytes:
    """One SSE message; the data is one line of JSON (json.dumps escapes newlines)."""
    data = json.dumps(ev.model_dump(mode="json"), separators=(",", ":"), default=str)
    return f"id: {ev.cursor or ev.stream_id or ''}\nevent: {ev.type}\ndata: {data}\n\n".encode()


@dataclass
class StreamState:
    """What the response learned, for the disconnect decision after it ends."""

    terminal_seen: bool = False


_DONE = object()


async def stepped(
    events: Generator[Event | None, None, None], **run: Any
) -> AsyncGenerator[Event | None, None]:
    """The items of a blocking event iterator, each stepped on a worker thread (`run`:
    `anyio.to_thread.run_sync`'s options); closed off the loop when the generator is, even
    when cancelled (closing unsubscribes: socket I/O).

    A step may outlive the coroutine that awaited it (the server cancels hard at shutdown;
    a cancelled MCP call abandons it); closing then only asks, and the step closes the
    iterator when it returns, since a generator cannot be closed while another thread runs
    it.
    """
    lock = threading.Lock()
    closed = threading.Event()

    def step() -> object:
        with lock:
            item = _DONE if closed.is_set() else next(events, _DONE)
            if closed.is_set():
                events.close()
            return item

    def close() -> None:
        closed.set()
        if lock.acquire(blocking=False):
            try:
                events.close()
            finally:
                lock.release()

    try:
        while (item := await anyio.to_thread.run_sync(step, **run)) is not _DONE:
            yield item  # type: ignore[misc]
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close, limiter=run.get("limiter"))


async def event_source(
    events: Generator[Event | None, None, None],
    state: StreamState,
    *,
    keep_alive_s: float,
    limiter: anyio.CapacityLimiter,
    on_event: Callable[[Event], None],
    closing: threading.Event,
) -> AsyncGenerator[bytes, None]:
    """SSE bytes from a blocking event iterator that yields None when it is quiet.

    Ends early, without a terminal event, once `closing` is set (server shutdown): the
    client reconnects with its last id, to this server's successor or another replica.
    """
    yield f"retry: {RETRY_MS}\n\n".encode()
    last_write = time.monotonic()
    try:
        async with aclosing(stepped(events, limiter=limiter)) as items:
            async for item in items:
                if closing.is_set():
                    return
                if item is None:
                    if time.monotonic() - last_write >= keep_alive_s:
                        last_write = time.monotonic()
                        yield KEEP_ALIVE
                    continue
                last_write = time.monotonic()
                on_event(item)
                # A sub-agent's relayed end is not the turn's.
                state.terminal_seen = item.ends_turn
                yield format_event(item)
                if state.terminal_seen:
                    return
    except REDIS_ERRORS as exc:
        # End the response; the client reconnects with its last id and loses nothing.
        log.warning("event stream lost Redis: %s", exc)


class EventStreamResponse(Response):
    """Streams `content`; if the client goes away first, awaits `on_disconnect`; then `on_close`."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        *,
        on_disconnect: Callable[[], Awaitable[None]],
        on_close: Callable[[], None],
    ) -> None:
        self.content = content
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.status_code = 200
        # nginx buffers responses unless told not to (X-Accel-Buffering); SSE must reach
        # the client now.
        self.init_headers({"Cache-Control": "no-cache, no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        complete = False

        async def stream(scope_: anyio.CancelScope) -> None:
            nonlocal disconnected, complete
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async for chunk in self.content:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                complete = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                disconnected = not complete  # ASGI >= 2.4 servers raise on a send to a gone client
            finally:
                # Cancelled while sending, the generator sits at a yield: close it now, not
                # whenever it is garbage collected, so its follow loop stops at once.
                with anyio.CancelScope(shield=True):
                    await self.content.aclose()
            scope_.cancel()

        async def listen(scope_: anyio.CancelScope) -> None:
            nonlocal disconnected
            while True:
                message: Message = await receive()
                if message["type"] == "http.disconnect":
                    # Servers also report a disconnect once the response is complete;
                    # only a client leaving mid-stream counts.
                    disconnected = not complete
                    scope_.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope)
                tg.start_soon(listen, tg.cancel_scope)
            if disconnected:
                with anyio.CancelScope(shield=True):
                    await self.on_disconnect()
        finally:
            # Last, so "closed" means the disconnect was handled too (tests wait on it).
            self.on_close()
