"""The gateway app: the routes of openapi.OPERATIONS, behind the cross-site guard and CORS."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agentq.api import Client
from agentq.errors import ConfigError, WebhookRefused
from agentq.gateway.console import console_handlers
from agentq.gateway.endpoints import STATIC_DIR, Gateway
from agentq.gateway.errors import EXCEPTION_HANDLERS
from agentq.gateway.guard import RequestGuard
from agentq.gateway.mcp_endpoint import McpEndpoint
from agentq.gateway.openapi import OPERATIONS, openapi_page
from agentq.telemetry import logs
from agentq.telemetry import redact as logredact
from agentq.webhooks.target import check_for_turn


def create_app(
    client: Client | None = None,
    *,
    heartbeat_s: float = 15.0,
    poll_s: float = 1.0,
    bind_host: str = "127.0.0.1",
) -> Starlette:
    """`heartbeat_s` between an idle stream's keep-alives; `poll_s` bounds how long a gone
    client goes unnoticed; `bind_host` is a Host the guard accepts."""
    # Here, not in `agentq serve`: `uvicorn --factory` must not log a token either.
    logredact.install()
    client = client or Client()
    # Built now, not in a request thread on the first turn's or abort's time.
    _ = client.app
    logs.install(client.settings.log_format)
    for name, url in client.settings.webhook_urls.items():
        try:
            check_for_turn(url, client.settings)
        except WebhookRefused as exc:
            raise ConfigError("AGENTQ_WEBHOOK_URLS", f"{name}: {exc.message}") from None
    gw = Gateway(client, heartbeat_s=heartbeat_s, poll_s=poll_s)
    origins = client.settings.cors_origins
    cors = Middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=["Authorization", "Content-Type", "Last-Event-ID"],
        expose_headers=["Location", "Retry-After"],
        max_age=600,
    )
    # CORS outermost, so a preflight is answered before the guard sees it.
    middleware = [
        *([cors] if origins else []),
        Middleware(RequestGuard, bind_host=bind_host, cors_origins=origins),
    ]
    mcp = McpEndpoint(gw)
    handlers: dict[str, Any] = {"mcp": mcp, "openapi_page": openapi_page}
    handlers.update((f.__name__, f) for f in console_handlers(gw))
    # One route per path and handler, in the document's order (`/v1/turns/active` before
    # `/v1/turns/{turn_id}`, which would otherwise take "active" for an id).
    methods: dict[tuple[str, str], list[str]] = {}
    for op in OPERATIONS:
        methods.setdefault((op.path, op.handler), []).append(op.method)
    routes = [
        Route(path, handlers.get(name) or getattr(gw, name), methods=m)
        if name != "static"
        else Mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
        for (path, name), m in methods.items()
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lambda app: mcp.manager.run(),
    )
    app.state.gateway = gw
    return app
