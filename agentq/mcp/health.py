"""How each MCP server last went, fleet-wide: the I/O workers write it (`agentq:mcp:health`),
the gateway reads it for /healthz, the console and `GET /v1/mcp/servers`. Kept apart from
the catalog so the gateway reads it without importing the worker side."""

from __future__ import annotations

import json
import time
from typing import Any

from agentq import constants as k
from agentq.mcp.listing import plan, read_listings
from agentq.mcp.servers import McpServer


def record_health(redis: Any, name: str, ok: bool, failures: int, error: str, worker: str) -> None:
    """How server `name`'s last start or call went (`error` never holds its headers)."""
    entry = {"ok": ok, "failures": failures, "error": error, "worker": worker, "at": time.time()}
    redis.hset(k.MCP_HEALTH, name, json.dumps(entry))


def server_health(redis: Any, *, detail: bool = False) -> dict[str, dict[str, Any]]:
    """How each MCP server's last start or call went, fleet-wide: `ok`, the `failures` in a
    row and when (public: /healthz); with `detail` the error and the worker too (the
    console, for admins)."""
    fields = ("ok", "failures", "at", "error", "worker") if detail else ("ok", "failures", "at")
    out = {}
    for name, raw in (redis.hgetall(k.MCP_HEALTH) or {}).items():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        key = name.decode() if isinstance(name, bytes) else str(name)
        out[key] = {f: entry.get(f) for f in fields}
    return out


def servers_view(redis: Any, servers: dict[str, McpServer]) -> list[dict[str, Any]]:
    """Every MCP server the fleet knows (configured here, or listed by a worker), for the
    console and `GET /v1/mcp/servers`."""
    listings = read_listings(redis)
    health = server_health(redis, detail=True)
    made = plan(servers, listings)
    offered: dict[str, list[dict[str, str]]] = {}
    for model_name, (owner, tool) in sorted(made.offered.items()):
        offered.setdefault(owner, []).append({"name": model_name, "tool": tool.name})
    out = []
    for name in sorted(set(servers) | set(listings)):
        server = servers.get(name)
        listing = listings.get(name)
        refused = [*(listing.refused if listing else []), *made.collisions.get(name, [])]
        out.append(
            {
                "name": name,
                "transport": server.transport if server else None,
                "where": server.describe() if server else None,
                "configured": server is not None,
                "listed_at": listing.listed_at if listing else None,
                "error": listing.error if listing else None,
                "tools": offered.get(name, []),
                "refused": [{"tool": r.tool, "why": r.why} for r in refused],
                "health": health.get(name),
            }
        )
    return out
