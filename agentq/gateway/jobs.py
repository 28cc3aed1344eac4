"""Background jobs on the HTTP API: schedules, as `agentq schedule` (`GET|POST /v1/schedules`,
`DELETE /v1/schedules/{name}`), and the recent webhook deliveries (`GET /v1/webhooks`); an
API key sees its own turns' deliveries through their timeline instead."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.config import Settings
from agentq.errors import ConfigError, WebhookRefused
from agentq.gateway.errors import NO_STORE
from agentq.gateway.validate import query_number, read_json
from agentq.schedules.spec import build_spec
from agentq.schedules.store import Schedules
from agentq.webhooks.target import check_for_turn

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway

MAX_LISTED = 200


def job_handlers(gw: Gateway) -> list[Endpoint]:
    @cache
    def schedules() -> Schedules:
        """Made on first use: behind Sentinel the gateway serves all else, and schedules
        answer with the ConfigError that says why they cannot run there."""
        c = gw.client
        return Schedules(c.app, c._store.redis, c.settings)

    def list_schedules(request: Request) -> Response:
        gw.require(request, "admin_key")
        return JSONResponse({"schedules": schedules().list()}, headers=NO_STORE)

    async def add_schedule(request: Request) -> Response:
        principal = gw.require(request, "admin_key")
        data: dict[str, Any] = await read_json(request, gw.body_limit_bytes)
        data["owner"] = principal.name if principal else None
        data.pop("created_at", None)
        spec = build_spec(data)
        if spec.webhook_url:
            check_for_turn(spec.webhook_url, gw.client.settings)
        spec = await run_in_threadpool(schedules().add, spec)
        return JSONResponse(
            {**spec.model_dump(), "when": spec.when},
            status_code=201,
            headers={"Location": f"/v1/schedules/{spec.name}", **NO_STORE},
        )

    def remove_schedule(request: Request) -> Response:
        gw.require(request, "admin_key")
        name = request.path_params["name"]
        schedules().remove(name)
        return JSONResponse({"ok": True, "name": name})

    def list_webhooks(request: Request) -> Response:
        gw.require(request, "admin")
        limit = query_number(request, "limit", 50, low=1, high=MAX_LISTED, integer=True, clamp=True)
        rows = gw.deliveries.recent(limit)
        return JSONResponse({"deliveries": [d.model_dump() for d in rows]}, headers=NO_STORE)

    return [list_schedules, add_schedule, remove_schedule, list_webhooks]


def check_key_webhooks(settings: Settings) -> None:
    """Each key's default webhook URL (AGENTQ_WEBHOOK_URLS), checked when the gateway starts."""
    for name, url in settings.webhook_urls.items():
        try:
            check_for_turn(url, settings)
        except WebhookRefused as exc:
            raise ConfigError("AGENTQ_WEBHOOK_URLS", f"{name}: {exc.message}") from None
