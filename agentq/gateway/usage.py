"""Spend over HTTP: `GET /v1/usage?since=&until=&key=&group_by=model|agent|key`
(docs/spend.md); without keys (loopback only) the caller sees every key's, as the CLI does."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.errors import Forbidden
from agentq.gateway.errors import NO_STORE, invalid

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway


def when(raw: str | None, name: str, *, end: bool = False) -> float | None:
    """A `since`/`until` value as epoch seconds: a UTC day (its start, or with `end` its
    last second) or a number."""
    if raw is None or raw == "":
        return None
    try:
        day = dt.datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=dt.timezone.utc)
        return day.timestamp() + (86399 if end else 0)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        raise invalid(f"{name}: a UTC day (YYYY-MM-DD) or epoch seconds") from None
    if not 0 <= value <= 1e11:
        raise invalid(f"{name}: out of range")
    return value


def usage_handlers(gw: Gateway) -> list[Endpoint]:
    async def usage(request: Request) -> Response:
        principal = gw.require(request, "key")
        q = request.query_params
        group_by = q.get("group_by") or "model"
        since = when(q.get("since"), "since")
        until = when(q.get("until"), "until", end=True)
        key = q.get("key") or None
        admin = principal is None or principal.admin
        if not admin and key is not None and principal is not None and key != principal.name:
            raise Forbidden("a key sees its own usage only")
        owner = principal.name if principal else None
        try:
            report = await run_in_threadpool(
                lambda: gw.client.usage(
                    since=since, until=until, key=key, group_by=group_by, owner=owner, admin=admin
                )
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return JSONResponse(report, headers=NO_STORE)

    return [usage]
