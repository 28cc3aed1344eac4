"""HTTP errors of the gateway: every refusal is JSON, `{"error": {"type", "message"}}`.

agentq's own exceptions map to a status here (TurnNotFound 404, AccessError subclasses
their `status_code`, ...); `ApiError` covers refusals that are only HTTP's business.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Any

import redis
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.errors import (
    AccessError,
    AgentqError,
    AnswerInvalid,
    BudgetExceeded,
    BudgetInvalid,
    ConversationBusy,
    ConversationNotFound,
    IdempotencyKeyReused,
    InteractionClosed,
    InteractionNotFound,
    PayloadTooLarge,
    RateLimited,
    ReplayRefused,
    ScheduleInvalid,
    ScheduleNotFound,
    TokenInvalid,
    TurnNotFound,
    Unauthorized,
    UnknownAgent,
    WaitpointRefused,
    WebhookRefused,
)
from agentq.gateway.limits import retry_after_header

log = logging.getLogger("agentq.gateway")


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


def _status_name(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "HTTPError"


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(
        exc.status_code, exc.type, exc.message, detail=exc.detail, headers=exc.headers
    )


async def _on_access_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AccessError)
    headers: dict[str, str] = {}
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = retry_after_header(exc.retry_after_s)
    return error_response(exc.status_code, type(exc).__name__, exc.message, headers=headers)


def _agentq_handler(status_code: int) -> Any:
    async def handler(request: Request, exc: Exception) -> Response:
        message = exc.message if isinstance(exc, AgentqError) else str(exc)
        return error_response(status_code, type(exc).__name__, message)

    return handler


async def _on_unknown_agent(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UnknownAgent)
    body = {"type": "UnknownAgent", "message": exc.message, "known_agents": exc.known}
    return JSONResponse({"error": body}, status_code=422)


async def _on_conversation_busy(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ConversationBusy)
    body = {
        "type": "ConversationBusy",
        "code": exc.code,
        "message": exc.message,
        "conversation_id": exc.conversation_id,
        "running_turn_id": exc.running_turn_id,
    }
    return JSONResponse({"error": body}, status_code=409)


async def _on_idempotency_reused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, IdempotencyKeyReused)
    body = {"type": "IdempotencyKeyReused", "code": exc.code, "message": exc.message}
    return JSONResponse({"error": body}, status_code=422)


async def _on_budget_exceeded(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BudgetExceeded)
    body: dict[str, Any] = {
        "type": "BudgetExceeded",
        "code": exc.code,
        "message": exc.message,
        "scope": exc.scope,
        "budget": exc.budget,
        "spent": exc.spent,
        "limit": exc.limit,
        "resets_at": exc.resets_at,
    }
    headers = {}
    if exc.resets_at is not None:
        headers["Retry-After"] = retry_after_header(max(0.0, exc.resets_at - time.time()))
    return JSONResponse({"error": body}, status_code=429, headers=headers)


async def _on_budget_invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BudgetInvalid)
    body = {"type": "BudgetInvalid", "code": exc.code, "message": exc.message}
    return JSONResponse({"error": body}, status_code=422)


async def _on_replay_refused(request: Request, exc: Exception) -> Response:
    """A retry or fork refused: its code, and the source's status or the field at fault."""
    assert isinstance(exc, ReplayRefused)
    body: dict[str, Any] = {"type": type(exc).__name__, "code": exc.code, "message": exc.message}
    for name in ("status", "field"):
        if hasattr(exc, name):
            body[name] = getattr(exc, name)
    return JSONResponse({"error": body}, status_code=exc.status_code)


async def _on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("%s %s: Redis: %s", request.method, request.url.path, exc)
    return error_response(503, "RedisUnavailable", f"{type(exc).__name__}: {exc}")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        exc.status_code, _status_name(exc.status_code), exc.detail, headers=dict(exc.headers or {})
    )


async def _on_waitpoint_refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, WaitpointRefused)
    body: dict[str, Any] = {
        "type": "WaitpointRefused",
        "message": exc.message,
        "waitpoint_id": exc.waitpoint_id,
    }
    if exc.first is not None:
        body["first"] = exc.first
    return JSONResponse({"error": body}, status_code=exc.status_code)


async def _on_crash(request: Request, exc: Exception) -> Response:
    return error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")


def exception_handlers() -> dict[Any, Any]:
    """Starlette's `exception_handlers` for the gateway."""
    return {
        ApiError: _on_api_error,
        HTTPException: _on_http_error,
        AccessError: _on_access_error,
        TurnNotFound: _agentq_handler(404),
        ReplayRefused: _on_replay_refused,
        ConversationNotFound: _agentq_handler(404),
        ConversationBusy: _on_conversation_busy,
        IdempotencyKeyReused: _on_idempotency_reused,
        BudgetExceeded: _on_budget_exceeded,
        BudgetInvalid: _on_budget_invalid,
        InteractionNotFound: _agentq_handler(404),
        InteractionClosed: _agentq_handler(409),
        AnswerInvalid: _agentq_handler(422),
        TokenInvalid: _agentq_handler(403),
        WaitpointRefused: _on_waitpoint_refused,
        PayloadTooLarge: _agentq_handler(413),
        UnknownAgent: _on_unknown_agent,
        WebhookRefused: _agentq_handler(422),
        ScheduleNotFound: _agentq_handler(404),
        ScheduleInvalid: _agentq_handler(422),
        AgentqError: _agentq_handler(400),
        redis.RedisError: _on_redis_error,
        Exception: _on_crash,
    }


__all__ = [
    "ApiError",
    "bearer",
    "error_response",
    "exception_handlers",
    "require_token",
    "validation_error",
]
