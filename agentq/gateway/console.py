"""The operator console's reads (its steering is `Gateway.steerer`'s). Model capacity is
for admins, like /metrics, and only names and numbers: never a deployment's URL, model or key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.gateway.auth import visible_to
from agentq.gateway.errors import NO_STORE, invalid
from agentq.gateway.metrics import read_snapshots
from agentq.llm.capacity import Capacity
from agentq.mcp.listing import server_health, servers_view
from agentq.mcp.servers import parse_servers
from agentq.state.listing import TurnLister, TurnQuery

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway


LIMITS = {"rpm", "tpm", "streams"}


def capacity_view(cap: Capacity, snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of `GET /v1/capacity`: each snapshot with its configured limits (or None)."""
    models = []
    for snap in snapshots:
        entry = cap.limits.get(snap["model"])
        routes = {d.name: d.model_dump(include=LIMITS) for d in entry.routes} if entry else {}
        deployments = {
            name: {**dep, "limits": routes.get(name)} for name, dep in snap["deployments"].items()
        }
        limits = None if entry is None else entry.model_dump(include={*LIMITS, "strategy"})
        models.append({**snap, "limits": limits, "deployments": deployments})
    now_ms = max((int(s["now_ms"]) for s in snapshots), default=None)
    return {"now_ms": now_ms, "models": models}


def console_handlers(gw: Gateway) -> list[Endpoint]:
    redis = gw.client._store.redis
    settings = gw.client.settings
    lister = TurnLister(redis)

    def list_turns(request: Request) -> Response:
        visible = visible_to(gw.require(request, "key"))
        q = request.query_params
        try:
            query = TurnQuery.parse(**{f: q.get(f) for f in ("status", "agent", "limit", "before")})
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return JSONResponse(vars(lister.page(query, visible)), headers=NO_STORE)

    def inbox(request: Request) -> Response:
        visible = visible_to(gw.require(request, "key"))
        pending = lister.pending_interactions(visible)
        return JSONResponse({"interactions": pending}, headers=NO_STORE)

    def turn_timeline(request: Request) -> Response:
        principal = gw.require(request, "key")
        turn_id = request.path_params["turn_id"]
        view = gw.client._timeline(turn_id, gw.authorize(turn_id, principal, None))
        default = f"{request.url.scheme}://{request.url.hostname}:{settings.flower_port}"
        view["flower_url"] = (settings.flower_url or default).rstrip("/")
        return JSONResponse(view, headers=NO_STORE)

    def capacity(request: Request) -> Response:
        gw.require(request, "admin")
        body = capacity_view(gw.capacity, read_snapshots(gw.capacity, settings))
        body["mcp_servers"] = panel = server_health(redis, detail=True)
        for server in servers():
            if server["refused"]:
                entry = panel.setdefault(server["name"], {"ok": True, "failures": 0})
                entry["refused"] = server["refused"]
        return JSONResponse(body, headers=NO_STORE)

    def servers() -> list[dict[str, Any]]:
        return servers_view(redis, parse_servers(settings.mcp_servers))

    def mcp_servers(request: Request) -> Response:
        gw.require(request, "admin")
        return JSONResponse({"servers": servers()}, headers=NO_STORE)

    return [list_turns, inbox, capacity, mcp_servers, turn_timeline]
