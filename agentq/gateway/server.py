"""Run the gateway under uvicorn: `agentq serve` (in a thread for tests: agentq.testing.gateway)."""

from __future__ import annotations

import contextlib
import socket

import uvicorn

from agentq.config import get_settings
from agentq.telemetry import logs

GRACEFUL_SHUTDOWN_S = 5
"""SSE streams end within a second of shutdown; past this, shutdown cancels what is left."""


class GatewayServer(uvicorn.Server):
    """uvicorn, telling the gateway first when it shuts down so SSE streams end cleanly."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app
        gateway = getattr(getattr(app, "state", None), "gateway", None)
        if gateway is not None:
            gateway.closing.set()
        await super().shutdown(sockets)


def serve(
    host: str | None = None, port: int | None = None, *, insecure_no_auth: bool = False
) -> int:
    """Serve until interrupted; without keys, a non-loopback `host` needs `insecure_no_auth`."""
    from agentq.gateway.app import create_app
    from agentq.gateway.auth import Keyring, check_bind

    settings = get_settings()
    bind_host = host or settings.gateway_host
    check_bind(bind_host, Keyring.from_settings(settings), insecure_no_auth=insecure_no_auth)
    config = uvicorn.Config(
        create_app(bind_host=bind_host),
        host=bind_host,
        port=settings.gateway_port if port is None else port,
        log_level="info",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    # uvicorn.Config set its own formatters after the app factory ran.
    logs.install(settings.log_format)
    server = GatewayServer(config)
    # uvicorn re-raises Ctrl-C after its graceful shutdown: for us, a normal stop.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 1
