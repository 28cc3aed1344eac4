"""The operator console's reads: the list of turns, one turn's timeline, the approvals inbox,
the fleet's model capacity and MCP servers (its steering, `/v1/console/turns/...`, is the
gateway's own abort, answer, retry and fork, as an operator: `Gateway.steerer`).

With keys configured, an API key lists its own turns and an admin key every turn. The
model capacity is fleet-wide, like /metrics: with keys configured (or
`AGENTQ_METRICS_TOKEN`), it needs an admin key (or that token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentq.gateway.auth import may_list
from agentq.gateway.capacity import capacity_view, read_snapshots
from agentq.gateway.context import NO_STORE
from agentq.gateway.errors import invalid
from agentq.mcp.health import server_health, servers_view
from agentq.mcp.servers import parse_servers
from agentq.state.listing import TurnLister, TurnQuery

if TYPE_CHECKING:
    from agentq.gateway.context import RouteContext


class Console:
    """The console's handlers, on the gateway's Client and keyring."""

    def __init__(self, gw: RouteContext) -> None:
        self.gw = gw
        self.redis = gw.client._store.redis
        self.lister = TurnLister(self.redis)

    def _viewer(self, request: Request) -> Callable[[dict[str, Any]], bool] | None:
        """Which turns the caller may list; None: every turn (no keys, loopback only)."""
        principal = self.gw.require_key(request)
        if principal is None:
            return None
        return lambda state: may_list(state, principal)

    async def list_turns(self, request: Request) -> Response:
        visible = self._viewer(request)
        q = request.query_params
        try:
            query = TurnQuery.parse(
                status=q.get("status"),
                agent=q.get("agent"),
                limit=q.get("limit"),
                before=q.get("before"),
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        page = await run_in_threadpool(self.lister.page, query, visible)
        return JSONResponse(page.to_json(), headers=NO_STORE)

    async def inbox(self, request: Request) -> Response:
        visible = self._viewer(request)
        pending = await run_in_threadpool(self.lister.pending_interactions, visible)
        return JSONResponse({"interactions": pending}, headers=NO_STORE)

    async def turn_timeline(self, request: Request) -> Response:
        principal = self.gw.require_key(request)
        turn_id = request.path_params["turn_id"]
        client = self.gw.client
        view = await run_in_threadpool(
            lambda: client._timeline(turn_id, self.gw.authorize(turn_id, principal, None))
        )
        view["flower_url"] = self.flower_url(request)
        return JSONResponse(view, headers=NO_STORE)

    def flower_url(self, request: Request) -> str:
        settings = self.gw.client.settings
        if settings.flower_url:
            return settings.flower_url.rstrip("/")
        return f"{request.url.scheme}://{request.url.hostname}:{settings.flower_port}"

    async def capacity(self, request: Request) -> Response:
        self.gw.require_admin_read(request)
        snapshots = await run_in_threadpool(
            read_snapshots, self.gw.capacity, self.gw.client.settings
        )
        body = capacity_view(self.gw.capacity, snapshots)
        # MCP servers (AGENTQ_MCP_SERVERS) that fail, with their errors, and the tools their
        # listings hold that are refused: admins only.
        body["mcp_servers"] = await run_in_threadpool(self._mcp_panel)
        return JSONResponse(body, headers=NO_STORE)

    def _servers(self) -> list[dict[str, Any]]:
        """What /v1/mcp/servers lists: AGENTQ_MCP_SERVERS, each with its tools' listing."""
        return servers_view(self.redis, parse_servers(self.gw.client.settings.mcp_servers))

    def _mcp_panel(self) -> dict[str, dict[str, Any]]:
        panel = server_health(self.redis, detail=True)
        for server in self._servers():
            if server["refused"]:
                entry = panel.setdefault(server["name"], {"ok": True, "failures": 0})
                entry["refused"] = server["refused"]
        return panel

    async def mcp_servers(self, request: Request) -> Response:
        self.gw.require_admin_read(request)
        view = await run_in_threadpool(self._servers)
        return JSONResponse({"servers": view}, headers=NO_STORE)


def console_routes(gw: RouteContext) -> list[Route]:
    """Routes to add to the gateway's; `GET /v1/turns` shares its path with the start."""
    c = Console(gw)
    return [
        Route("/v1/turns", c.list_turns, methods=["GET"]),
        Route("/v1/interactions", c.inbox, methods=["GET"]),
        Route("/v1/capacity", c.capacity, methods=["GET"]),
        Route("/v1/mcp/servers", c.mcp_servers, methods=["GET"]),
        Route("/v1/turns/{turn_id}/timeline", c.turn_timeline, methods=["GET"]),
    ]
