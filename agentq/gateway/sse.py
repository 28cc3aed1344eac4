"""Server-sent events: a turn's events as an ASGI response that notices disconnects."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from contextlib import aclosing
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


_DONE = object()


async def stepped(
    events: Generator[Event | None, None, None], **run: Any
) -> AsyncGenerator[Event | None, None]:
    """The items of a blocking event iterator, each stepped on a worker thread (`run`:
    `run_sync`'s options), closed off the loop (it unsubscribes: socket I/O) even when
    cancelled. A step may outlive its awaiter: closing then only asks, and the step closes
    the iterator as it returns (a generator cannot be closed while a thread runs it)."""
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
    *,
    keep_alive_s: float,
    limiter: anyio.CapacityLimiter,
    on_event: Callable[[Event], None],
    closing: threading.Event,
) -> AsyncGenerator[bytes, None]:
    """SSE bytes from a blocking event iterator that yields None when it is quiet; ends
    early once `closing` is set (shutdown): the client reconnects with its last id."""
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
                yield format_event(item)
                # A sub-agent's relayed end is not the turn's.
                if item.ends_turn:
                    return
    except REDIS_ERRORS as exc:
        # End the response; the client reconnects with its last id and loses nothing.
        log.warning("event stream lost Redis: %s", exc)


class EventStreamResponse(StreamingResponse):
    """Streams `content`, awaits `on_disconnect` if the client left early, then `on_close`."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        *,
        on_disconnect: Callable[[], Awaitable[None]],
        on_close: Callable[[], None],
    ) -> None:
        # nginx buffers responses unless told not to; SSE must reach the client now.
        headers = {"Cache-Control": "no-cache, no-store", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers)
        self.content, self.on_disconnect, self.on_close = content, on_disconnect, on_close
        self.complete = False

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
            self.complete = True
        finally:
            # Cancelled while sending, the generator sits at a yield: close it now, not
            # whenever it is garbage collected, so its follow loop stops at once.
            with anyio.CancelScope(shield=True):
                await self.content.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # ASGI >= 2.4 servers raise on a send to a gone client.
            with contextlib.suppress(ClientDisconnect):
                await super().__call__(scope, receive, send)
            if not self.complete:
                with anyio.CancelScope(shield=True):
                    await self.on_disconnect()
        finally:
            # Last, so "closed" means the disconnect was handled too (tests wait on it).
            self.on_close()
