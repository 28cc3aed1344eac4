"""What the gateway checks before Redis, so nothing a client sends ends as a 500 or 503."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import Request

from agentq.errors import PayloadTooLarge
from agentq.gateway.errors import ApiError, invalid
from agentq.models import REQUEST_ID, TURN_ID, lone_surrogate_at

MAX_JSON_DEPTH = 32
"""Deeper than any valid request (a message part is 5 levels down); json would recurse."""
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def client_host(request: Request) -> str:
    return request.client.host if request.client else ""


def turn_id_of(value: str) -> str:
    if not TURN_ID.fullmatch(value):
        raise ApiError(404, "TurnNotFound", "no such turn: a turn id is 32 lowercase hex digits")
    return value


def request_id_of(value: str) -> str:
    if not REQUEST_ID.fullmatch(value):
        raise ApiError(
            404,
            "InteractionNotFound",
            "no such interaction: a request id is '<call id>.approval', the call id of "
            "letters, digits and _ . : - (at most 128)",
        )
    return value


def query_number(
    request: Request,
    name: str,
    default: Any,
    *,
    low: float,
    high: float,
    integer: bool = False,
    clamp: bool = False,
) -> Any:
    """The query parameter `name` from `low` to `high` (`clamp`: brought in), else 422."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise invalid(f"{name}: not {'an integer' if integer else 'a number'}: {raw!r}") from None
    if clamp and math.isfinite(value):
        return min(max(value, low), high)
    # NaN is in no range.
    if not low <= value <= high:
        raise invalid(f"{name}: must be between {low:g} and {high:g}")
    return value


def _raise_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_json_value(request: Request, limit_bytes: int) -> Any:
    """The body as any strict JSON value, refusing (413) past `limit_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge("request body", int(declared), limit_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise PayloadTooLarge("request body", len(body), limit_bytes)
    depth = 0
    for bracket in _BRACKET.finditer(_STRING.sub(b'""', body)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"body: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_raise_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(422, "MalformedJSON", f"body: not valid JSON ({exc})") from None
    bad = lone_surrogate_at(data)
    if bad is not None:
        raise ApiError(
            422, "MalformedJSON", f"{bad}: text must be valid Unicode (a lone surrogate is not)"
        )
    return data


async def read_json(request: Request, limit_bytes: int) -> dict[str, Any]:
    data = await read_json_value(request, limit_bytes)
    if not isinstance(data, dict):
        raise invalid("body: must be a JSON object")
    return data
