"""How each MCP server last went, fleet-wide: the I/O workers write it (`agentq:mcp:health`),
the gateway reads it for /healthz and the console. Kept apart from the catalog so the
gateway reads it without importing the worker side."""

from __future__ import annotations

import json
from typing import Any

from agentq import constants as k


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
