"""How the gateway answers: every refusal is JSON, `{"error": {"type", "message"}}`."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.errors import (
    REDIS_ERRORS,
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
    field_errors,
)
from agentq.gateway.limits import retry_after_header

if TYPE_CHECKING:
    from agentq.models import TurnHandle

log = logging.getLogger("agentq.gateway")
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request, Exception], Awaitable[Response]]
NO_STORE = {"Cache-Control": "no-store"}
"""For an answer that holds a caller's own data."""


def accepted(handle: TurnHandle) -> Response:
    return JSONResponse(
        handle.model_dump(exclude_none=True),
        status_code=202,
        headers={"Location": f"/v1/turns/{handle.turn_id}", **NO_STORE},
    )


class ApiError(HTTPException):
    """An HTTP-level refusal, not one of agentq's own errors (`extra`: more body fields)."""

    def __init__(self, status_code: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(status_code, message)
        self.type_, self.extra = type_, extra


def error_response(
    status_code: int, type_: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"type": type_, "message": message, **extra}
    return JSONResponse({"error": body}, status_code=status_code, headers=headers)


def invalid(message: str) -> ApiError:
    """422 ValidationError: `message` starts with the field at fault."""
    return ApiError(422, "ValidationError", message)


def validated(model: type[M], data: Any) -> M:
    """`data` as `model`, else 422 naming the first bad field, every problem in `detail`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        detail = [{"field": f, "message": m} for f, m in field_errors(exc, "body")]
    raise ApiError(422, "ValidationError", "{field}: {message}".format(**detail[0]), detail=detail)


def bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def _headers(exc: AgentqError) -> dict[str, str]:
    if isinstance(exc, Unauthorized):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, RateLimited):
        return {"Retry-After": retry_after_header(exc.retry_after_s)}
    if isinstance(exc, BudgetExceeded) and exc.resets_at is not None:
        return {"Retry-After": retry_after_header(max(0.0, exc.resets_at - time.time()))}
    return {}


def _agentq_handler(status_code: int | None, *fields: str, **renamed: str) -> Handler:
    """Answers `status_code` (None: the error's own) with the error's type, message and
    each of `fields` it has that is not None (`renamed`: name in the body = attribute)."""
    pairs = [*zip(fields, fields, strict=True), *renamed.items()]

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, AgentqError)
        extra = {name: getattr(exc, a) for name, a in pairs if getattr(exc, a, None) is not None}
        status = getattr(exc, "status_code", 400) if status_code is None else status_code
        return error_response(status, type(exc).__name__, exc.message, _headers(exc), **extra)

    return handler


async def _on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("%s %s: Redis: %s", request.method, request.url.path, exc)
    return error_response(503, "RedisUnavailable", f"{type(exc).__name__}: {exc}")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if isinstance(exc, ApiError):
        return error_response(exc.status_code, exc.type_, exc.detail, **exc.extra)
    # Starlette's own (an unknown path, a method not allowed): standard codes only.
    name = HTTPStatus(exc.status_code).phrase.replace(" ", "").replace("-", "")
    return error_response(exc.status_code, name, exc.detail, dict(exc.headers or {}))


async def _on_crash(request: Request, exc: Exception) -> Response:
    return error_response(500, "InternalError", f"{type(exc).__name__}: {exc}")


EXCEPTION_HANDLERS: dict[Any, Handler] = {
    HTTPException: _on_http_error,
    AccessError: _agentq_handler(None),
    TurnNotFound: _agentq_handler(404),
    ReplayRefused: _agentq_handler(None, "code", "status", "field"),
    ConversationNotFound: _agentq_handler(404),
    ConversationBusy: _agentq_handler(409, "code", "conversation_id", "running_turn_id"),
    IdempotencyKeyReused: _agentq_handler(422, "code"),
    BudgetExceeded: _agentq_handler(None, "code", "scope", "budget", "spent", "limit", "resets_at"),
    BudgetInvalid: _agentq_handler(422, "code"),
    InteractionNotFound: _agentq_handler(404),
    InteractionClosed: _agentq_handler(409),
    AnswerInvalid: _agentq_handler(422),
    TokenInvalid: _agentq_handler(403),
    WaitpointRefused: _agentq_handler(None, "waitpoint_id", "first"),
    PayloadTooLarge: _agentq_handler(413),
    UnknownAgent: _agentq_handler(422, known_agents="known"),
    WebhookRefused: _agentq_handler(422),
    ScheduleNotFound: _agentq_handler(404),
    ScheduleInvalid: _agentq_handler(422),
    AgentqError: _agentq_handler(400),
    **dict.fromkeys(REDIS_ERRORS, _on_redis_error),
    Exception: _on_crash,
}
