"""The gateway on a thread of this process, on a loopback port, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette

from agentq.fleet.lifecycle import Started
from agentq.gateway.server import GRACEFUL_SHUTDOWN_S, GatewayServer

START_TIMEOUT_S = 10.0


class BackgroundServer(Started):
    """A real uvicorn server on a thread, on a loopback port bound before start.

    with BackgroundServer(create_app()) as server:
        httpx.get(server.url + "/healthz")
    """

    def __init__(self, app: Starlette) -> None:
        # proto=IPPROTO_TCP, or asyncio skips TCP_NODELAY on accepted sockets (+40 ms a reply).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        # The graceful shutdown `agentq serve` has: an open SSE stream ends at its next poll
        # (up to a second), and a shorter grace cut streams a loaded machine had not ended.
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        )
        self.server = GatewayServer(config)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            name=f"uvicorn-{self.port}",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the gateway server thread exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with contextlib.suppress(OSError):
            self._sock.close()
