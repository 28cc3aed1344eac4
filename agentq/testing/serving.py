"""The scripted model server's HTTP: uvicorn (the gateway's server) on one asyncio loop in a
thread of its own, and the connection an answer is played on.

A thousand slow streams cost a socket and a task each, not a thread. Answers need what ASGI
does not give an app: cutting a connection mid-body (a broken stream) and counting the
connections accepted (keep-alive tests), so the server keeps each connection's transport,
by client address, from uvicorn's protocol. `stop()` cuts every connection at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from agentq.errors import MissingExtra

try:
    import uvicorn
    from starlette.requests import Request
except ImportError as exc:  # the core install has neither
    raise MissingExtra("local", exc.name or "uvicorn", "the scripted model server") from None
try:
    # uvicorn's C parser when installed (the `local` extra): a streamed round of 50 chunks
    # costs about 0.7 ms of CPU on it, 1.1 ms on the pure-Python h11
    # (scripts/bench_scripted_server.py).
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Protocol
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Protocol  # type: ignore[assignment]

__all__ = ["ClientGone", "Conn", "Handler", "Request", "ThreadedServer", "error_body"]

IDLE_S = 120.0
"""How long a connection may wait for its next request; longer than clients keep idle
pooled connections (httpx: 5 s), so the client is the one to close them."""
_BACKLOG = 2048

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed its end while we were answering."""


def error_body(kind: str, message: str) -> bytes:
    """An error in the shape OpenAI answers with."""
    error = {"message": message, "type": kind, "param": None, "code": kind}
    return json.dumps({"error": error}).encode()


Message = dict[str, Any]

GONE_WAIT_S = 1.0
"""How long an answer whose client went away waits for uvicorn to see the close."""


class Conn:
    """One request's response, as the code answering it plays it: whole, or as chunks."""

    def __init__(
        self,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
        transport: asyncio.Transport,
    ) -> None:
        self._receive = receive
        self._send = send
        self._transport = transport
        self.close = False
        """Answer with `Connection: close`: uvicorn closes the connection after the response."""
        self.responded = False
        """Whether the response has started."""

    async def _start(self, status: int, headers: Mapping[str, str]) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if self.close:
            raw.append((b"connection", b"close"))
        await self._out({"type": "http.response.start", "status": status, "headers": raw})
        self.responded = True

    async def _out(self, message: Message) -> None:
        # uvicorn drops what is sent to a closed connection without a word: check first.
        if self._transport.is_closing():
            raise ClientGone
        await self._send(message)

    async def respond(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        """A whole response with a Content-Length."""
        await self._start(status, {**headers, "content-length": str(len(body))})
        await self._out({"type": "http.response.body", "body": body})

    async def start_chunked(self, status: int, headers: Mapping[str, str]) -> None:
        """The head of a response whose body follows in chunks (no Content-Length)."""
        await self._start(status, headers)

    async def send_chunk(self, payload: bytes) -> None:
        await self._out({"type": "http.response.body", "body": payload, "more_body": True})

    async def end_chunked(self, payload: bytes = b"") -> None:
        """Send `payload`, if any, and end the body."""
        await self._out({"type": "http.response.body", "body": payload})

    async def wait_gone(self, timeout_s: float | None) -> bool:
        """Whether the client closes within `timeout_s`."""
        try:
            while (await asyncio.wait_for(self._receive(), timeout_s))["type"] != "http.disconnect":
                pass
        except asyncio.TimeoutError:
            return False
        return True

    async def cut(self) -> None:
        """End the connection now, mid-response: what was sent goes out, then a FIN."""
        self._transport.close()
        # Until uvicorn has seen the close: returning before, with the body unfinished, is
        # an app error to it.
        await self.wait_gone(None)


Handler = Callable[[Conn, Request], Awaitable[None]]
"""Answers one request on its connection."""


class ThreadedServer:
    """Serves `handler` with uvicorn on host:port from a thread of its own, between start()
    and stop()."""

    def __init__(self, handler: Handler, *, host: str, port: int, name: str) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._name = name
        self._transports: dict[tuple[str, int], asyncio.Transport] = {}
        self._serving: set[asyncio.Task[Any]] = set()
        self._accepted = 0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._address: tuple[str, int] | None = None

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
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto=IPPROTO_TCP, or asyncio skips TCP_NODELAY on accepted sockets (+40 ms a reply).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(
            self._app,
            http=self._protocol(),
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,
            log_config=None,
            access_log=False,
            timeout_keep_alive=int(IDLE_S),
            backlog=_BACKLOG,
        )
        server = uvicorn.Server(config)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self._run, args=(loop, server, sock), name=self._name, daemon=True
        )
        self._stopping, self._accepted = False, 0
        self._loop, self._thread, self._server = loop, thread, server
        thread.start()
        while not server.started:
            if not thread.is_alive():
                self.stop()
                raise RuntimeError(f"{self._name} did not start: see its log")
            time.sleep(0.005)
        host, port = sock.getsockname()[:2]
        self._address = (str(host), int(port))

    def stop(self) -> None:
        """Close the listener and every connection, cancel every answer and join the thread."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        self._address = None
        if loop is None or thread is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(self._cut_all)
        thread.join()

    def _run(self, loop: asyncio.AbstractEventLoop, server: uvicorn.Server, sock: Any) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        finally:
            sock.close()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def _cut_all(self) -> None:
        """Stop: uvicorn shuts down at its next tick, with no connection or answer left."""
        self._stopping = True
        assert self._server is not None
        self._server.should_exit = True
        for transport in list(self._transports.values()):
            transport.abort()
        # After the aborts' connection_lost callbacks, which are queued first: each answer
        # then ends on a closed connection, which uvicorn does not call an app error.
        for task in list(self._serving):
            task.cancel()

    def _protocol(self) -> type[_Protocol]:
        owner = self

        class Tracked(_Protocol):
            """uvicorn's protocol, keeping each open connection's transport by address."""

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                owner._accepted += 1
                if (peer := _peer(transport)) is not None:
                    owner._transports[peer] = transport
                super().connection_made(transport)
                if owner._stopping:  # accepted before uvicorn's next tick closes the listener
                    transport.abort()

            def connection_lost(self, exc: Exception | None) -> None:
                peer = _peer(self.transport)
                if peer is not None and owner._transports.get(peer) is self.transport:
                    del owner._transports[peer]
                super().connection_lost(exc)

        return Tracked

    async def _app(self, scope: Message, receive: Any, send: Any) -> None:
        client = scope.get("client")
        transport = self._transports.get((str(client[0]), int(client[1]))) if client else None
        if transport is None or transport.is_closing():
            return
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        conn = Conn(receive, send, transport)
        request = Request(scope, receive)
        try:
            try:
                await self._handler(conn, request)
            except ClientGone:
                # The transport may close before uvicorn has run its connection_lost:
                # returning first, with the body unfinished, is an app error to it, as in
                # `Conn.cut`.
                await conn.wait_gone(GONE_WAIT_S)
        except asyncio.CancelledError:
            # stop() cancels us (in the handler or that wait); ending normally keeps
            # uvicorn from logging an app error.
            if not self._stopping:
                raise
        except Exception:
            log.exception("%s: %s %s failed", self._name, request.method, request.url.path)
            if not conn.responded:
                await conn.respond(500, error_body("server_error", "the server failed"), {})
            else:
                await conn.cut()
        finally:
            self._serving.discard(task)


def _peer(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
    """The client's address, as uvicorn gives it in an ASGI scope."""
    peer = transport.get_extra_info("peername")
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
