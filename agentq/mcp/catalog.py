"""The configured MCP servers' tools in this process's registry, and the listings the
fleet shares through Redis.

Every worker process loads each server's listing at start: from Redis (`agentq:mcp:tools`)
when some process listed it within AGENTQ_MCP_TOOLS_TTL_S, else by listing it itself (a
short-lived session; one process at a time per server). Reads of the registry look at Redis
every few seconds for a newer listing, so a server's `notifications/tools/list_changed`,
heard by the I/O worker that holds its session, which lists it again at once, reaches the
turn workers within seconds; a listing past its TTL is made again by whoever reads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import McpServerUnavailable
from agentq.mcp.link import ServerLink, explain
from agentq.mcp.listing import ListedTool, Listing, plan, printable
from agentq.mcp.servers import McpServer, parse_servers
from agentq.mcp.tools import make_spec
from agentq.tools import registry
from agentq.tools.registry import ToolSpec

log = logging.getLogger("agentq.mcp")

POLL_S = 5.0
"""How often registry reads look at Redis for newer listings."""
LIST_TIMEOUT_S = 60.0
"""Longest a listing (a server's start included) may take."""
AWAIT_POLL_S = 0.1
"""How often a starting process looks for the listing another process is making."""
RETRY_FAILED_S = 30.0
"""A server that could not be listed is tried again after this (or its TTL, if shorter)."""


class McpTools:
    """This process's MCP servers: their sessions (used by the I/O worker) and listings."""

    def __init__(
        self, servers: dict[str, McpServer], ttl_s: float, redis: Callable[[], Any]
    ) -> None:
        self.servers = servers
        self.ttl_s = ttl_s
        self._redis = redis
        self.links = {name: ServerLink(s, self._list_changed) for name, s in servers.items()}
        self.applied: dict[str, float] = {}
        self.listings: dict[str, Listing] = {}
        self._told: set[str] = set()
        self.registered: dict[str, set[str]] = {name: set() for name in servers}
        self.on_new_tools: Callable[[list[ToolSpec]], None] | None = None
        """Told of tools a listing added after start (the I/O worker registers their tasks)."""
        self._looked = 0.0
        self._busy = threading.Lock()
        self._apply_lock = threading.RLock()
        self._listing_now: set[str] = set()

    # -- listings

    def load(self) -> None:
        """At start: every server's listing, shared or made here (blocking)."""
        with self._busy:
            self._looked = time.monotonic()
            self._bring_up_to_date(force=True)

    def refresh(self) -> None:
        """Before a registry read: newer listings from Redis, every POLL_S at most."""
        if time.monotonic() - self._looked < POLL_S or not self._busy.acquire(blocking=False):
            return
        try:
            self._looked = time.monotonic()
            if _in_event_loop():
                return
            self._bring_up_to_date(force=False)
        except Exception as exc:
            log.warning("MCP listings not refreshed: %s", explain(exc))
        finally:
            self._busy.release()

    def _bring_up_to_date(self, *, force: bool) -> None:
        """At start (`force`) a missing or stale listing is made (or awaited) here; later it
        is made on a thread of its own, so the turn step that reads the registry never
        waits for a server, and the listing so far serves until the new one is in."""
        shared = self._read()
        stale = {
            n: shared.get(n) for n in self.servers if n not in shared or self._stale(shared[n])
        }
        if force and stale:
            # All at once: a server slow to start (or never answering) delays the others'
            # listings, and the worker's start, by its own start timeout only.
            with concurrent.futures.ThreadPoolExecutor(len(stale)) as pool:
                made = {
                    n: pool.submit(self._list_here, self.servers[n], old, wait=True)
                    for n, old in stale.items()
                }
                for n, fut in made.items():
                    shared_now = fut.result() or stale[n]
                    if shared_now is not None:
                        shared[n] = shared_now
        elif stale:
            for n, old in stale.items():
                self._list_in_background(self.servers[n], old)
        for name in self.servers:
            listing = shared.get(name)
            if listing is not None and (force or listing.listed_at > self.applied.get(name, -1)):
                try:
                    self.apply(name, listing)
                except Exception as exc:
                    # Whatever a listing holds, it costs its server's tools, not the worker.
                    log.warning("MCP server %s: tools not taken: %s", name, explain(exc))

    def _list_in_background(self, server: McpServer, previous: Listing | None) -> None:
        with self._apply_lock:
            if server.name in self._listing_now:
                return
            self._listing_now.add(server.name)

        def run() -> None:
            try:
                listing = self._list_here(server, previous, wait=False)
                if listing is not None:
                    self.apply(server.name, listing)
            except Exception as exc:
                log.warning("MCP server %s: tools not listed: %s", server.name, explain(exc))
            finally:
                with self._apply_lock:
                    self._listing_now.discard(server.name)

        threading.Thread(target=run, name=f"agentq-mcp-list-{server.name}", daemon=True).start()

    def _stale(self, listing: Listing) -> bool:
        age_s = time.time() - listing.listed_at
        return age_s > (min(self.ttl_s, RETRY_FAILED_S) if listing.error else self.ttl_s)

    def _read(self) -> dict[str, Listing]:
        try:
            raw = self._redis().hgetall(k.MCP_TOOLS)
        except Exception as exc:
            log.warning("MCP listings not read from Redis: %s", explain(exc))
            return {}
        out = {}
        for name, value in raw.items():
            key = name.decode() if isinstance(name, bytes) else str(name)
            try:
                out[key] = Listing.from_json(value)
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _write(self, name: str, listing: Listing) -> None:
        try:
            self._redis().hset(k.MCP_TOOLS, name, listing.to_json())
        except Exception as exc:
            log.warning("MCP listing of %s not shared: %s", name, explain(exc))

    def _list_here(
        self, server: McpServer, previous: Listing | None, *, wait: bool
    ) -> Listing | None:
        """List the server with a session of its own. When another process is at it: None,
        or with `wait` (at start, where the worker's tasks are made from the listing) the
        listing that process shares."""
        lock = k.mcp_listing_key(server.name)
        try:
            if not self._redis().set(lock, "1", nx=True, px=int(LIST_TIMEOUT_S * 1000)):
                return self._await_listing(server.name, previous) if wait else None
        except Exception:
            pass  # without Redis this process lists for itself
        # The listing is shared before the lock goes: a process waiting for it takes a
        # missing lock to mean the listing is there.
        try:
            try:
                tools = _run_async(lambda: _list_once(server), LIST_TIMEOUT_S)
                listing = Listing.screened(time.time(), tools)
                log.info("MCP server %s lists %d tools", server.name, len(tools))
            except Exception as exc:
                why = explain(exc)
                log.warning("MCP server %s: tools not listed: %s", server.name, why)
                listing = Listing(time.time(), previous.tools if previous else [], error=why)
                self._health(server.name, why)
            self._write(server.name, listing)
        finally:
            with contextlib.suppress(Exception):
                self._redis().delete(lock)
        return listing

    def _await_listing(self, name: str, previous: Listing | None) -> Listing | None:
        since = previous.listed_at if previous is not None else 0.0
        deadline = time.monotonic() + LIST_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(AWAIT_POLL_S)
            listing = self._read().get(name)
            if listing is not None and listing.listed_at > since:
                return listing
            if not self._redis().exists(k.mcp_listing_key(name)):
                # Read again: the listing may have been written since the read above (an I/O
                # worker that started without a server's tools refused their calls' tasks).
                return self._read().get(name, listing)
        return None

    def _health(self, name: str, error: str) -> None:
        entry = {"ok": False, "failures": 1, "error": error, "worker": "", "at": time.time()}
        try:
            self._redis().hset(k.MCP_HEALTH, name, json.dumps(entry))
        except Exception:
            log.debug("MCP health not recorded", exc_info=True)

    def apply(self, name: str, listing: Listing) -> list[ToolSpec]:
        """Put the listing's tools (those the allowlist keeps) in the registry, in place of
        the server's earlier ones; returns the tools that were not there before."""
        with self._apply_lock:
            return self._apply(name, listing)

    def _apply(self, name: str, listing: Listing) -> list[ToolSpec]:
        self.applied[name] = listing.listed_at
        self.listings[name] = listing
        for refused in listing.refused:
            self._tell(name, refused.tool, refused.why)
        made = plan(self.servers, self.listings)
        for server, refusals in made.collisions.items():
            for refused in refusals:
                self._tell(server, refused.tool, refused.why)
        own = {n for n, s in registry.all_tools().items() if not getattr(s, "mcp_server", "")}
        wanted: dict[str, dict[str, ListedTool]] = {s: {} for s in self.servers}
        for model_name, (server, tool) in made.offered.items():
            if model_name in own:
                self._tell(server, printable(tool.name), f"{model_name} names a tool of this fleet")
            else:
                wanted[server][model_name] = tool
        added: list[ToolSpec] = []
        for server, tools in wanted.items():
            before = self.registered[server]
            for gone in before - set(tools):
                registry.unregister(gone)
            # Only the listed server's tools are made again; another's change only when a
            # shared name appears or goes.
            fresh = tools if server == name else {n: t for n, t in tools.items() if n not in before}
            for model_name, tool in fresh.items():
                try:
                    spec = make_spec(self.servers[server], tool, self.links)
                except Exception as exc:
                    self._tell(server, printable(tool.name), f"not made: {explain(exc)}")
                    tools.pop(model_name)
                    continue
                registry.register(spec)
                if model_name not in before:
                    added.append(spec)
            self.registered[server] = set(tools)
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
        asyncio.get_running_loop().create_task(self._relist(name), name=f"agentq-mcp-{name}-list")

    async def _relist(self, name: str) -> None:
        try:
            tools = await self.links[name].list_tools()
        except McpServerUnavailable as exc:
            log.warning("%s", exc.message)
            return
        listing = Listing.screened(time.time(), tools)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._write, name, listing)
        await loop.run_in_executor(None, self.apply, name, listing)
        log.info("MCP server %s changed its tools: %d now", name, len(tools))

    # -- the sessions

    async def close(self) -> None:
        """On the loop: stop every session (the worker is going)."""
        await asyncio.gather(*(link.stop("the worker stops") for link in self.links.values()))


async def _list_once(server: McpServer) -> list[ListedTool]:
    link = ServerLink(server)
    try:
        return await link.list_tools()
    finally:
        await link.stop("listed")


def _run_async(make: Callable[[], Any], timeout_s: float) -> Any:
    """Run a coroutine to its end on a loop of its own, in a thread of its own."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agentq-mcp-list")
    try:
        return pool.submit(lambda: asyncio.run(make())).result(timeout_s)
    finally:
        pool.shutdown(wait=False)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_lock = threading.Lock()
_tools: McpTools | None = None


def load_mcp(settings: Settings, redis: Callable[[], Any]) -> McpTools | None:
    """Load the tools of AGENTQ_MCP_SERVERS into this process's registry (once); None when
    no server is configured. A bad setting raises ConfigError, naming it."""
    global _tools
    servers = parse_servers(settings.mcp_servers)
    with _lock:
        if _tools is not None:
            return _tools
        if not servers:
            return None
        tools = McpTools(servers, settings.mcp_tools_ttl_s, redis)
        tools.load()
        registry.add_refresher(tools.refresh)
        _tools = tools
        return tools


def loaded() -> McpTools | None:
    return _tools
