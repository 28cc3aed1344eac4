"""The MCP servers' tools in this process's registry: I/O workers list the servers and share
the listings in Redis, every other process only reads them (docs/mcp.md, "Listings")."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.signals import worker_init, worker_shutdown

from agentq import constants as k
from agentq.aio import host as aio_host
from agentq.config import Settings
from agentq.errors import MissingExtra
from agentq.fleet import roles
from agentq.mcp.link import ServerLink, explain
from agentq.mcp.listing import Listing, plan, printable, read_listings, record_health
from agentq.mcp.servers import McpServer, parse_servers
from agentq.mcp.tools import make_spec
from agentq.tools import registry

log = logging.getLogger("agentq.mcp")

POLL_S = 5.0
"""How often registry reads look at Redis for newer listings."""
LIST_TIMEOUT_S = 60.0
"""Longest a listing (a server's start included) may take."""
RETRY_FAILED_S = 30.0
"""A server that could not be listed is tried again after this (or its TTL, if shorter)."""
STOP_TIMEOUT_S = 15.0


class McpTools:
    """This process's MCP servers: their sessions (used by the I/O worker) and listings."""

    def __init__(
        self, servers: dict[str, McpServer], ttl_s: float, redis: Callable[[], Any]
    ) -> None:
        self.servers = servers
        self.ttl_s = ttl_s
        self._redis = redis
        self.links = {name: ServerLink(s, self._list_changed) for name, s in servers.items()}
        self.listings: dict[str, Listing] = {}
        self._told: set[str] = set()
        self.registered: dict[str, str] = {}
        """The model name of each tool this registry holds -> its server."""
        self.on_new_tools: Callable[[list[registry.ToolSpec]], None] | None = None
        """Told of tools a later listing added (the I/O worker registers their tasks)."""
        self._looked = 0.0
        self._keeper: asyncio.Task[Any] | None = None
        self._busy = threading.Lock()
        self._apply_lock = threading.RLock()

    def refresh(self) -> None:
        """Take newer shared listings, every POLL_S at most (always while a server has none)."""
        due = time.monotonic() - self._looked >= POLL_S or len(self.listings) < len(self.servers)
        if not due or _in_event_loop() or not self._busy.acquire(blocking=False):
            return
        try:
            self._looked = time.monotonic()
            for name, listing in read_listings(self._redis()).items():
                applied = self.listings.get(name)
                newer = applied is None or listing.listed_at > applied.listed_at
                if name in self.servers and newer:
                    self.apply(name, listing)
        except Exception as exc:
            log.warning("MCP listings not read from Redis: %s", explain(exc))
        finally:
            self._busy.release()

    async def list_all(self) -> None:
        """List every server at once: one slow to start delays the others by its timeout only."""
        await asyncio.gather(*(self._list(name) for name in self.servers))

    async def keep_listed(self) -> None:
        """List each server again when its listing's TTL has passed, until `close`."""
        self._keeper = asyncio.current_task()
        while True:
            soonest = min(self._due_at(name) for name in self.servers)
            await asyncio.sleep(max(soonest - time.time(), 1.0))
            # Due as of now: a server listed meanwhile (`tools/list_changed`) is not.
            now = time.time()
            await asyncio.gather(*(self._list(n) for n in self.servers if self._due_at(n) <= now))

    def _due_at(self, name: str) -> float:
        listing = self.listings.get(name)
        if listing is None:
            return time.time()
        ttl_s = min(self.ttl_s, RETRY_FAILED_S) if listing.error else self.ttl_s
        return listing.listed_at + ttl_s

    async def _list(self, name: str) -> None:
        """List one server, share the listing and take it; a failure keeps its last tools."""
        try:
            tools = await asyncio.wait_for(self.links[name].list_tools(), LIST_TIMEOUT_S)
            listing = Listing.screened(time.time(), tools)
            log.info("MCP server %s lists %d tools", name, len(tools))
        except Exception as exc:
            why = explain(exc)
            log.warning("MCP server %s: tools not listed: %s", name, why)
            previous = self.listings.get(name)
            tools = previous.tools if previous else []
            listing = Listing(listed_at=time.time(), tools=tools, error=why)
        await asyncio.get_running_loop().run_in_executor(None, self._share, name, listing)

    def _share(self, name: str, listing: Listing) -> None:
        """Write the listing (and a failed one's error, as the server's health), then take it."""
        try:
            redis = self._redis()
            redis.hset(k.MCP_TOOLS, name, listing.model_dump_json())
            if listing.error:
                record_health(redis, name, False, 1, listing.error, "")
        except Exception as exc:
            log.warning("MCP listing of %s not shared: %s", name, explain(exc))
        self.apply(name, listing)

    def apply(self, name: str, listing: Listing) -> list[registry.ToolSpec]:
        """Put the listing's allowed tools in the registry in place of the server's earlier ones;
        returns those new. A bad listing costs its server's tools, never the worker."""
        try:
            with self._apply_lock:
                return self._apply(name, listing)
        except Exception as exc:
            log.warning("MCP server %s: tools not taken: %s", name, explain(exc))
            return []

    def _apply(self, name: str, listing: Listing) -> list[registry.ToolSpec]:
        self.listings[name] = listing
        made = plan(self.servers, self.listings)
        for server, refusals in [(name, listing.refused), *made.collisions.items()]:
            for refused in refusals:
                self._tell(server, refused.tool, refused.why)
        own = {n for n, s in registry.all_tools().items() if not s.mcp_server}
        for gone in set(self.registered) - (set(made.offered) - own):
            registry.unregister(gone)
            del self.registered[gone]
        added: list[registry.ToolSpec] = []
        for model_name, (server, tool) in made.offered.items():
            before = self.registered.get(model_name)
            if model_name in own:
                self._tell(server, printable(tool.name), f"{model_name} names a tool of this fleet")
                continue
            if before == server and server != name:
                continue  # another server's tool changes only when a shared name appears or goes
            try:
                spec = make_spec(self.links[server], tool)
            except Exception as exc:
                self._tell(server, printable(tool.name), f"not made: {explain(exc)}")
                continue
            registry.register(spec)
            self.registered[model_name] = server
            if before is None:
                added.append(spec)
        if added and self.on_new_tools is not None:
            self.on_new_tools(added)
        return added

    def _tell(self, server: str, tool: str, why: str) -> None:
        """Log a refused tool once in this process's life, not at every listing applied."""
        line = f"MCP server {server}: tool {tool} is not offered: {why}"
        if line not in self._told:
            self._told.add(line)
            log.warning("%s", line)

    def _list_changed(self, name: str) -> None:
        """On the loop: the server said its tools changed; list them on its session now."""
        asyncio.get_running_loop().create_task(self._list(name), name=f"agentq-mcp-{name}-list")

    async def close(self) -> None:
        """On the loop: stop listing and every session (the worker is going)."""
        if self._keeper is not None:
            self._keeper.cancel()
        await asyncio.gather(*(link.stop("the worker stops") for link in self.links.values()))


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_tools: McpTools | None = None


def load_mcp(settings: Settings, redis: Callable[[], Any]) -> None:
    """Load the tools of AGENTQ_MCP_SERVERS into this process's registry (ConfigError)."""
    global _tools
    servers = parse_servers(settings.mcp_servers)
    if not servers:
        return
    MissingExtra.check("mcp", "AGENTQ_MCP_SERVERS")
    _tools = McpTools(servers, settings.mcp_tools_ttl_s, redis)
    registry.refresher = _tools.refresh


def _stop_sessions(**_: Any) -> None:
    """Close every MCP session on the loop (a stdio server's stdin, then a kill if it lingers)."""
    tools = _tools
    if tools is None or roles.role != "io":
        return
    try:
        aio_host.get_host().loop.submit(tools.close).result(STOP_TIMEOUT_S)
    except Exception:
        log.warning("MCP sessions not all stopped in time", exc_info=True)


def connect_mcp(register: Callable[[dict[str, registry.ToolSpec]], Any]) -> None:
    """Connect the signals after the worker's own: its role is decided before the listing,
    and a warm shutdown lets the calls on the loop end before their sessions stop."""

    def list_at_start(sender: Any = None, **_: Any) -> None:
        """List every server before the worker consumes (else a call of a tool it lacks a task
        for is dropped as unknown), then keep them listed."""
        tools = _tools
        if tools is None or roles.role != "io":
            return

        def added(specs: list[registry.ToolSpec]) -> None:
            register({s.name: s for s in specs})
            # The consumer is told, or calls of a tool added later are refused as unknown.
            update = getattr(getattr(sender, "consumer", None), "update_strategies", None)
            if callable(update):
                update()
            log.info("MCP tools added: %s", ", ".join(s.name for s in specs))

        tools.on_new_tools = added
        loop = aio_host.get_host().loop.loop
        try:
            asyncio.run_coroutine_threadsafe(tools.list_all(), loop).result(LIST_TIMEOUT_S + 5)
        except Exception:
            log.warning("MCP servers not all listed at start", exc_info=True)
        asyncio.run_coroutine_threadsafe(tools.keep_listed(), loop)

    worker_init.connect(list_at_start, weak=False, dispatch_uid="agentq.mcp.list")
    worker_shutdown.connect(_stop_sessions, weak=False, dispatch_uid="agentq.mcp.stop")
