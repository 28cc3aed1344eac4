"""What a server's `tools/list` yields (each bad tool costs only itself), the model names
all listings together give (`plan`), and each server's health: the gateway reads these
without importing the worker side."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from agentq import constants as k
from agentq.mcp.servers import McpServer

MAX_REMOTE_NAME = 256
"""The longest tool name taken (MCP suggests 128)."""
MAX_DESCRIPTION = 4096
"""The longest description kept; a longer one is cut, with a marker saying so."""
MAX_SCHEMA_BYTES = 64 * 1024
"""The largest input schema taken (as JSON): every request of a turn carries it."""
SEPARATOR = "__"
MAX_NAME = 64
"""The longest function name the OpenAI API accepts."""
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_HASH_CHARS = 8
T = TypeVar("T")


def tool_name(server: str, tool: str) -> str:
    """`SERVER__TOOL` when that is a valid function name, else made one, ending in a short hash
    of the original; its characters are safe in a task name too."""
    name = f"{server}{SEPARATOR}{tool}"
    if FUNCTION_NAME.match(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    safe = _UNSAFE.sub("_", name)
    return f"{safe[: MAX_NAME - _HASH_CHARS - 1]}_{digest}"


class ListedTool(BaseModel):
    """One tool as the server lists it: what a process needs to offer and check calls."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool | None = None
    destructive: bool | None = None


class Refused(BaseModel):
    """A tool of a listing that is not offered, and why."""

    model_config = ConfigDict(frozen=True)

    tool: str
    why: str


class Listing(BaseModel):
    """What a server listed, as the fleet shares it in Redis (its JSON)."""

    listed_at: float
    tools: list[ListedTool] = []
    error: str = ""
    refused: list[Refused] = []

    @classmethod
    def screened(cls, listed_at: float, tools: list[ListedTool]) -> Listing:
        """The tools that pass `problem`, the others refused (a name listed twice, each time)."""
        counts = Counter(t.name for t in tools)
        twice = {name: f"listed {n} times" for name, n in counts.items() if n > 1}
        whys = [(t, problem(t) or twice.get(t.name)) for t in tools]
        refused = {Refused(tool=printable(t.name), why=why): None for t, why in whys if why}
        kept = [t for t, why in whys if why is None]
        return cls(listed_at=listed_at, tools=kept, refused=list(refused))


def read_listings(redis: Any) -> dict[str, Listing]:
    """The listings the fleet shares in Redis (`agentq:mcp:tools`), those that parse."""
    return _by_server(redis, k.MCP_TOOLS, Listing.model_validate_json)


def _by_server(redis: Any, key: str, parse: Callable[[Any], T]) -> dict[str, T]:
    out = {}
    for name, raw in redis.hgetall(key).items():
        with contextlib.suppress(ValueError):  # pydantic's ValidationError among them
            out[name.decode()] = parse(raw)
    return out


def problem(tool: ListedTool) -> str | None:
    """Why a listed tool cannot be a function the model calls, or None."""
    from jsonschema.validators import validator_for

    if not tool.name:
        return "it has no name"
    if len(tool.name) > MAX_REMOTE_NAME:
        return f"its name is {len(tool.name)} characters long (at most {MAX_REMOTE_NAME})"
    schema = tool.input_schema
    size = len(json.dumps(schema))  # parsed from the server's JSON, so JSON again
    if size > MAX_SCHEMA_BYTES:
        return f"its input schema is {size} bytes long (at most {MAX_SCHEMA_BYTES})"
    try:
        validator_for(schema).check_schema(schema)
    except Exception as exc:
        message = getattr(exc, "message", None) or str(exc)
        return f"its input schema is not JSON Schema: {printable(message, 200)}"
    if schema.get("type", "object") != "object":
        return f"its input schema is of type {printable(str(schema.get('type')), 40)}, not object"
    return None


def cut_description(text: str) -> str:
    if len(text) <= MAX_DESCRIPTION:
        return text
    return f"{text[:MAX_DESCRIPTION]}... [cut: {len(text) - MAX_DESCRIPTION} characters more]"


def printable(text: str, limit: int = 80) -> str:
    """A server's string as a log line may show it: one line, bounded."""
    flat = text.encode("unicode_escape").decode("ascii")
    return flat if len(flat) <= limit else f"{flat[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Plan:
    """The MCP tools of the fleet by model name, and the tools refused for a shared name."""

    offered: dict[str, tuple[str, ListedTool]]
    """Model name -> (server, tool)."""
    collisions: dict[str, list[Refused]]
    """Server -> its tools refused because another tool maps to the same model name."""


def plan(servers: dict[str, McpServer], listings: dict[str, Listing]) -> Plan:
    """Which tool each model name is; a name two tools would share is refused for all."""
    named: dict[str, list[tuple[str, ListedTool]]] = {}
    for name, listing in listings.items():
        # A server this process was not told of (the gateway's view) has no allowlist here.
        allowed = servers[name].tools if name in servers else None
        for listed in listing.tools:
            if allowed is None or listed.name in allowed:
                named.setdefault(tool_name(name, listed.name), []).append((name, listed))
    offered: dict[str, tuple[str, ListedTool]] = {}
    collisions: dict[str, list[Refused]] = {}
    for model_name, owners in named.items():
        if len(owners) == 1:
            offered[model_name] = owners[0]
            continue
        for owner, tool in owners:
            others = ", ".join(f"{s}/{printable(t.name)}" for s, t in owners if t is not tool)
            why = f"its name {model_name} is also the name of {others}"
            collisions.setdefault(owner, []).append(Refused(tool=printable(tool.name), why=why))
    return Plan(offered, collisions)


def record_health(redis: Any, name: str, ok: bool, failures: int, error: str, worker: str) -> None:
    """How server `name`'s last start or call went (`error` never holds its headers)."""
    entry = {"ok": ok, "failures": failures, "error": error, "worker": worker, "at": time.time()}
    redis.hset(k.MCP_HEALTH, name, json.dumps(entry))


def server_health(redis: Any, *, detail: bool = False) -> dict[str, dict[str, Any]]:
    """How each MCP server last went (public: /healthz); `detail` adds error and worker."""
    fields = ("ok", "failures", "at", "error", "worker") if detail else ("ok", "failures", "at")
    entries = _by_server(redis, k.MCP_HEALTH, json.loads)
    return {name: {f: entry.get(f) for f in fields} for name, entry in entries.items()}


def servers_view(redis: Any, servers: dict[str, McpServer]) -> list[dict[str, Any]]:
    """Every MCP server configured here or listed by a worker, for `GET /v1/mcp/servers`."""
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
