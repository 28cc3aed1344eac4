"""An HTTP/1.1 server on one asyncio loop in one background thread.

Thousands of slow keep-alive connections cost a socket and a task each, not a thread;
`stop()` closes the listener and every connection at once and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

from agentq.testing.http_wire import (
    MAX_HEAD_BYTES,
    BadRequest,
    ClientGone,
    Conn,
    Request,
    error_body,
    read_request,
)

Handler = Callable[[Conn, Request], Awaitable[bool]]
"""Answers one request; returns whether the connection may serve another."""

IDLE_S = 120.0
"""How long a connection may wait for its next request; longer than clients keep idle
pooled connections (httpx: 5 s), so the client is the one to close them."""
_BACKLOG = 1024
_STOP_WAIT_S = 2.0
_LINGER_S = 2.0

log = logging.getLogger(__name__)


class _Tracked(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, keeping every open transport in `open_transports` from
    the moment of the accept: one accepted just before stop() has no task yet."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        open_transports: set[asyncio.Transport],
    ) -> None:
        super().__init__(reader, serve)
        self._open = open_transports
        self._mine: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):
            self._mine = transport
            self._open.add(transport)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._mine is not None:
            self._open.discard(self._mine)
        super().connection_lost(exc)


class BackgroundHTTPServer:
    """Serves `handler` on host:port from a thread of its own, between start() and stop()."""

    def __init__(self, handler: Handler, *, host: str, port: int, name: str) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.Transport] = set()
        self._accepted = 0
        self._stopping = False

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("the server is not started")
        return self._address

    @property
    def connections_accepted(self) -> int:
        """TCP connections accepted since start(), idle or busy, open or closed."""
        return self._accepted

    def start(self) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        thread.start()
        self._stopping = False
        self._accepted = 0
        try:
            server = asyncio.run_coroutine_threadsafe(self._listen(), loop).result()
        except BaseException:
            _end_loop(loop, thread)
            raise
        host, port = server.sockets[0].getsockname()[:2]
        self._loop, self._thread, self._server = loop, thread, server
        self._address = (str(host), int(port))

    def stop(self) -> None:
        """Close the listener and every connection, cancel every answer and join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        finally:
            _end_loop(loop, thread)
            self._loop = self._thread = self._server = None
            self._address = None

    async def _listen(self) -> asyncio.Server:
        loop = asyncio.get_running_loop()

        def protocol() -> _Tracked:
            reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES, loop=loop)
            return _Tracked(reader, self._serve, self._transports)

        return await loop.create_server(protocol, self._host, self._port, backlog=_BACKLOG)

    async def _shutdown(self) -> None:
        self._stopping = True
        if self._server is not None:
            # Stop accepting, and let the connections accepted already get their transport
            # before the close: Python 3.11 refuses (and leaks the open socket of) a
            # transport made for a server that has closed.
            loop = asyncio.get_running_loop()
            for sock in self._server.sockets:
                loop.remove_reader(sock.fileno())
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            self._server.close()
        me = asyncio.current_task()
        # Again while tasks remain: a connection accepted as the listener closed starts its
        # task late, sees the stop and ends on its own.
        for _ in range(3):
            self._abort_all()
            for task in list(self._serving):
                task.cancel()
            others = [t for t in asyncio.all_tasks() if t is not me]
            if not others:
                break
            await asyncio.wait(others, timeout=_STOP_WAIT_S)
        # Whatever is still open (accepted too late for a task, or a task that did not
        # end in time) is cut here; then their connection_lost runs and closes the sockets.
        self._abort_all()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    def _abort_all(self) -> None:
        """Cut every accepted connection, with or without a task serving it."""
        for transport in list(self._transports):
            transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self._accepted += 1
        self._serving.add(task)
        try:
            if not self._stopping:
                await self._requests(conn)
        except asyncio.CancelledError:
            # Ending normally when stop() cancels us matters: Python 3.11's stream protocol
            # logs a cancelled connection task as an unhandled exception.
            if not self._stopping:
                raise
        finally:
            self._serving.discard(task)
            if self._stopping:
                writer.transport.abort()
            else:
                writer.close()

    async def _requests(self, conn: Conn) -> None:
        """Answer requests on one connection until it cannot or need not serve another."""
        while True:
            conn.responded = False
            try:
                request = await asyncio.wait_for(read_request(conn.reader, conn.writer), IDLE_S)
            except asyncio.TimeoutError:
                return
            except BadRequest as exc:
                await _refuse(conn, exc.status, "invalid_request_error", exc.message)
                return
            except ConnectionError:
                return
            if request is None:
                return
            try:
                reuse = await self._handler(conn, request)
            except ClientGone:
                return
            except Exception:
                log.exception("%s: %s %s failed", self._name, request.method, request.target)
                if not conn.responded:
                    await _refuse(conn, 500, "server_error", "the scripted server failed")
                return
            if not (reuse and request.keep_alive) or conn.gone():
                return


async def _refuse(conn: Conn, status: int, kind: str, message: str) -> None:
    """Answer a request we will not serve; the caller then closes the connection."""
    headers = {"Content-Type": "application/json"}
    with contextlib.suppress(ClientGone):
        await conn.respond(status, error_body(kind, message), headers, close=True)
        # Closing with request bytes unread sends a reset that can destroy the answer in
        # flight: half-close and drop what the client still sends until it closes too.
        if conn.writer.can_write_eof():
            conn.writer.write_eof()
        await conn.wait_gone(_LINGER_S)


def _end_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
