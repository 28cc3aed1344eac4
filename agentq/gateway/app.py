"""The HTTP gateway: REST for turns, SSE for their events, the web page, health and metrics.

Every Redis call (the Client's methods, the event follow loop) runs in a worker thread,
never on the event loop. Errors are JSON: ``{"error": {"type": ..., "message": ...}}``.

An SSE client that shows the turn's token (``Authorization: Bearer`` or ``?token=``,
since EventSource cannot set headers) on a turn started attached (``detach: false``)
owns it: if that client goes away before the turn's terminal event, the turn is
aborted with reason ``disconnect``. Without a token, the stream is read-only.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import redis
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agentq.api import Client
from agentq.errors import (
    AgentqError,
    InteractionClosed,
    InteractionNotFound,
    PayloadTooLarge,
    TokenInvalid,
    TurnNotFound,
)
from agentq.gateway.metrics import CONTENT_TYPE, EventObserver, GatewayMetrics
from agentq.gateway.sse import EventStreamResponse, StreamState, event_source, replay_all
from agentq.models import TERMINAL_STATUSES, Event, InteractionAnswer, TurnRequest

log = logging.getLogger("agentq.gateway")

STATIC_DIR = Path(__file__).resolve().parent / "static"
BODY_MARGIN_BYTES = 64 * 1024
"""Room for JSON escaping and the other fields above `max_prompt_bytes`."""
HEALTH_TIMEOUT_S = 2.0
_STREAM_ID = re.compile(r"^(0|\d+-\d+)$")
# The page loads only its own script and style: no inline code, nothing from elsewhere.
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class ApiError(Exception):
    """An HTTP-level refusal that is not one of agentq's own errors."""

    def __init__(
        self,
        status_code: int,
        type_: str,
        message: str,
        *,
        detail: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.type = type_
        self.message = message
        self.detail = detail
        self.headers = headers


def error_response(
    status_code: int,
    type_: str,
    message: str,
    *,
    detail: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"type": type_, "message": message}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse({"error": body}, status_code=status_code, headers=headers)


def validation_error(exc: ValidationError) -> ApiError:
    """422 whose message names the first bad field, with every problem in `detail`."""
    detail = [
        {"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
        for e in exc.errors()
    ]
    first = detail[0] if detail else {"field": "body", "message": "invalid"}
    return ApiError(422, "ValidationError", f"{first['field']}: {first['message']}", detail=detail)


async def read_json(request: Request, limit_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, refusing (413) before reading more than `limit_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge("request body", int(declared), limit_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise PayloadTooLarge("request body", len(body), limit_bytes)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(422, "MalformedJSON", f"body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ApiError(422, "ValidationError", "body: must be a JSON object")
    return data


def bearer(request: Request, *, allow_query: bool = False) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if allow_query:
        return request.query_params.get("token") or None
    return None


def require_token(request: Request) -> str:
    token = bearer(request)
    if token is None:
        raise ApiError(
            401,
            "Unauthorized",
            "this call needs the turn's token: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token


class Gateway:
    """The endpoints, sharing one Client, one metrics registry and the SSE thread limiter."""

    def __init__(
        self,
        client: Client,
        *,
        heartbeat_s: float,
        poll_s: float,
        observe_events: bool,
        max_streams: int,
    ) -> None:
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.metrics = GatewayMetrics()
        # Open streams hold a thread each; their own limiter keeps REST calls answering.
        self.stream_limiter = anyio.CapacityLimiter(max_streams)
        self.observer = EventObserver(client.store.redis, self.metrics) if observe_events else None
        self.body_limit_bytes = client.settings.max_prompt_bytes + BODY_MARGIN_BYTES
        self.closing = threading.Event()

    def begin_shutdown(self) -> None:
        """End open SSE streams cleanly (within `poll_s`) instead of being cancelled."""
        self.closing.set()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.observer is not None:
            self.observer.start()
        try:
            yield
        finally:
            if self.observer is not None:
                await run_in_threadpool(self.observer.stop)

    # -- turns ---------------------------------------------------------------------

    async def start_turn(self, request: Request) -> Response:
        data = await read_json(request, self.body_limit_bytes)
        if "parent_turn_id" in data:
            # Only a running turn may start sub-agents; over HTTP it would graft onto any turn.
            raise ApiError(422, "ValidationError", "parent_turn_id: not accepted over HTTP")
        try:
            req = TurnRequest.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if not req.initial_messages():
            raise ApiError(422, "ValidationError", "prompt: a turn needs a prompt or messages")
        handle = await run_in_threadpool(self.client.start, req)
        return JSONResponse(
            handle.model_dump(),
            status_code=202,
            headers={"Location": f"/v1/turns/{handle.turn_id}", "Cache-Control": "no-store"},
        )

    async def get_turn(self, request: Request) -> Response:
        turn = await run_in_threadpool(self.client.get, request.path_params["turn_id"])
        return JSONResponse(turn)

    async def active(self, request: Request) -> Response:
        return JSONResponse({"turns": await run_in_threadpool(self.client.active)})

    async def abort(self, request: Request) -> Response:
        token = require_token(request)
        turn_id = request.path_params["turn_id"]
        await run_in_threadpool(self.client.abort, turn_id, token, "user")
        return JSONResponse({"ok": True, "turn_id": turn_id})

    async def answer(self, request: Request) -> Response:
        token = require_token(request)
        turn_id = request.path_params["turn_id"]
        request_id = request.path_params["request_id"]
        data = await read_json(request, self.body_limit_bytes)
        try:
            ans = InteractionAnswer.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        await run_in_threadpool(
            self.client.answer, turn_id, request_id, token, ans.decision, ans.value
        )
        return JSONResponse(
            {"ok": True, "turn_id": turn_id, "request_id": request_id, "decision": ans.decision}
        )

    # -- events ----------------------------------------------------------------------

    def _keep_alive_s(self, request: Request) -> float:
        raw = request.query_params.get("heartbeat")
        if raw is None:
            return self.heartbeat_s
        try:
            value = float(raw)
        except ValueError:
            raise ApiError(422, "ValidationError", "heartbeat: must be seconds") from None
        if not math.isfinite(value):
            raise ApiError(422, "ValidationError", "heartbeat: must be seconds")
        return min(max(value, 0.05), 60.0)

    async def events(self, request: Request) -> Response:
        turn_id = request.path_params["turn_id"]
        token = bearer(request, allow_query=True)
        # The header wins: EventSource resends it on every reconnect, the URL never changes.
        after = (
            request.headers.get("last-event-id") or request.query_params.get("after") or "0-0"
        ).strip()
        if not _STREAM_ID.match(after):
            raise ApiError(422, "ValidationError", "Last-Event-ID: must be a stream id like 1-0")
        keep_alive_s = self._keep_alive_s(request)
        poll_s = min(self.poll_s, keep_alive_s)
        opened = await run_in_threadpool(self._open_events, turn_id, token, after, poll_s)
        if opened is None:
            # The turn ended and the client has its last event: 204 stops EventSource retrying.
            return Response(status_code=204)
        events, owner = opened
        state = StreamState()

        def on_event(ev: Event) -> None:
            self.metrics.streamed(ev.type)

        async def on_disconnect() -> None:
            if not owner or state.terminal_seen:
                return
            log.info("turn %s: its attached client disconnected; aborting", turn_id)
            try:
                await run_in_threadpool(self.client.abort, turn_id, token, "disconnect")
            except TurnNotFound:
                pass  # it ended in the meantime
            except (AgentqError, redis.RedisError) as exc:
                log.warning("turn %s: abort on disconnect failed: %s", turn_id, exc)

        self.metrics.sse_connections.inc()
        body = event_source(
            events,
            state,
            keep_alive_s=keep_alive_s,
            limiter=self.stream_limiter,
            on_event=on_event,
            closing=self.closing,
        )
        return EventStreamResponse(
            body, on_disconnect=on_disconnect, on_close=self.metrics.sse_connections.dec
        )

    def _open_events(
        self, turn_id: str, token: str | None, after: str, poll_s: float
    ) -> tuple[Iterator[Event | None], bool] | None:
        state = self.client.store.state(turn_id)
        if state is None:
            raise TurnNotFound(turn_id)
        owner = False
        if token is not None:
            self.client.check_token(turn_id, token)
            owner = not state.get("detach")
        if state.get("status") in TERMINAL_STATUSES:
            bus = self.client.store.bus
            if not bus.replay(turn_id, after, count=1):
                return None
            return replay_all(bus, turn_id, after), False
        return self.client.events(turn_id, after_id=after, heartbeat_s=poll_s), owner

    # -- page, health, metrics ---------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return FileResponse(
            STATIC_DIR / "index.html",
            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"},
        )

    async def healthz(self, request: Request) -> Response:
        ok = False
        error = f"no answer within {HEALTH_TIMEOUT_S:g}s"
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                # Abandoned on timeout: a hung socket must not hang the health check.
                ok = bool(
                    await anyio.to_thread.run_sync(
                        self.client.store.redis.ping, abandon_on_cancel=True
                    )
                )
            except redis.RedisError as exc:
                error = f"{type(exc).__name__}: {exc}"
        if ok:
            return JSONResponse({"ok": True, "redis": "ok"})
        return JSONResponse(
            {"ok": False, "error": {"type": "RedisUnavailable", "message": error}}, status_code=503
        )

    async def metrics_page(self, request: Request) -> Response:
        active = None
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                active = await anyio.to_thread.run_sync(self.client.active, abandon_on_cancel=True)
            except redis.RedisError as exc:
                log.warning("metrics: cannot read active turns: %s", exc)
        if active is None:
            self.metrics.redis_up.set(0)
        else:
            self.metrics.refresh_active(active)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _status_name(status_code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status_code).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "HTTPError"


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status_code, exc.type, exc.message, detail=exc.detail, headers=exc.headers
    )


def _agentq_handler(status_code: int) -> Any:
    async def handler(request: Request, exc: Exception) -> Response:
        message = exc.message if isinstance(exc, AgentqError) else str(exc)
        return error_response(status_code, type(exc).__name__, message)

    return handler


async def _on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("%s %s: Redis: %s", request.method, request.url.path, exc)
    return error_response(503, "RedisUnavailable", f"{type(exc).__name__}: {exc}")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        exc.status_code, _status_name(exc.status_code), exc.detail, headers=dict(exc.headers or {})
    )


async def _on_crash(request: Request, exc: Exception) -> Response:
    return error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")


def create_app(
    client: Client | None = None,
    *,
    heartbeat_s: float = 15.0,
    poll_s: float = 1.0,
    observe_events: bool = True,
    max_streams: int = 1000,
) -> Starlette:
    """The gateway app.

    `heartbeat_s` is how often an idle SSE stream gets a keep-alive comment (a request
    may ask for another with ``?heartbeat=``); `poll_s` bounds how long a client's
    disconnect can go unnoticed; `observe_events` feeds fleet-wide events to /metrics.
    """
    gw = Gateway(
        client or Client(),
        heartbeat_s=heartbeat_s,
        poll_s=poll_s,
        observe_events=observe_events,
        max_streams=max_streams,
    )
    routes = [
        Route("/", gw.index, methods=["GET"]),
        Route("/healthz", gw.healthz, methods=["GET"]),
        Route("/metrics", gw.metrics_page, methods=["GET"]),
        Route("/v1/turns", gw.start_turn, methods=["POST"]),
        # Before /v1/turns/{turn_id}, which would otherwise take "active" for an id.
        Route("/v1/turns/active", gw.active, methods=["GET"]),
        Route("/v1/turns/{turn_id}", gw.get_turn, methods=["GET"]),
        Route("/v1/turns/{turn_id}/events", gw.events, methods=["GET"]),
        Route("/v1/turns/{turn_id}/abort", gw.abort, methods=["POST"]),
        Route("/v1/turns/{turn_id}/interactions/{request_id}", gw.answer, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _on_api_error,
        HTTPException: _on_http_error,
        TurnNotFound: _agentq_handler(404),
        InteractionNotFound: _agentq_handler(404),
        InteractionClosed: _agentq_handler(409),
        TokenInvalid: _agentq_handler(403),
        PayloadTooLarge: _agentq_handler(413),
        AgentqError: _agentq_handler(400),
        redis.RedisError: _on_redis_error,
        Exception: _on_crash,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=gw.lifespan)
    app.state.gateway = gw
    return app


__all__ = ["ApiError", "Gateway", "create_app"]
