"""What an I/O worker does for its MCP servers beyond running calls: it lists them on its
sessions at start (before it consumes: the tasks of their tools are registered from the
listing) and whenever a listing's TTL has passed, gives the tools a later listing adds
their tasks, and stops its sessions (stdio servers with them) when it goes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from celery.signals import worker_init, worker_ready, worker_shutdown

from agentq.fleet.roles import current_role
from agentq.mcp.catalog import LIST_TIMEOUT_S, McpTools, loaded
from agentq.tools.registry import ToolSpec

log = logging.getLogger("agentq.mcp")

STOP_TIMEOUT_S = 15.0


Register = Callable[[dict[str, ToolSpec]], Any]
_register: Register | None = None
_consumer: Any = None
_keeper: concurrent.futures.Future[None] | None = None


def _io_tools() -> McpTools | None:
    tools = loaded()
    return tools if tools is not None and current_role() == "io" else None


def _list_at_start(**_: Any) -> None:
    """List every server before the worker consumes: a call of a tool whose task this
    worker lacks would be dropped as an unknown task."""
    tools = _io_tools()
    if tools is None or _register is None:
        return
    register = _register

    def added(specs: list[ToolSpec]) -> None:
        register({s.name: s for s in specs})
        # A tool a server adds later (`tools/list_changed`, a TTL's listing): the consumer
        # is told, or its calls would be refused as unknown tasks.
        update = getattr(_consumer, "update_strategies", None)
        if callable(update):
            update()
        log.info("MCP tools added: %s", ", ".join(s.name for s in specs))

    tools.on_new_tools = added
    loop = _loop()
    try:
        asyncio.run_coroutine_threadsafe(tools.list_all(), loop).result(LIST_TIMEOUT_S + 5)
    except Exception:
        log.warning("MCP servers not all listed at start", exc_info=True)


def _keep_listed(sender: Any = None, **_: Any) -> None:
    global _consumer, _keeper
    tools = _io_tools()
    if tools is None:
        return
    _consumer = sender
    _keeper = asyncio.run_coroutine_threadsafe(tools.keep_listed(), _loop())


def _loop() -> asyncio.AbstractEventLoop:
    from agentq.aio.host import get_host

    return get_host().loop.loop


def _stop_sessions(**_: Any) -> None:
    """Close every MCP session on the loop: a stdio server is told (stdin closed), then
    killed if it lingers. (A worker killed outright takes them along: agentq.mcp.child.)"""
    tools = _io_tools()
    if tools is None:
        return
    if _keeper is not None:
        _keeper.cancel()
    from agentq.aio import host as aio_host

    host = aio_host._host
    if host is None:
        return
    try:
        host.loop.submit(tools.close).result(STOP_TIMEOUT_S)
    except Exception:
        log.warning("MCP sessions not all stopped in time", exc_info=True)


def connect(register: Register) -> None:
    """Connect the signals; the worker does it after its own, so its role is decided
    before the listing, and a warm shutdown lets the calls on the loop end before their
    sessions stop. `register` registers tools' tasks."""
    global _register
    _register = register
    worker_init.connect(_list_at_start, weak=False, dispatch_uid="agentq.mcp.list")
    worker_ready.connect(_keep_listed, weak=False, dispatch_uid="agentq.mcp.keep")
    worker_shutdown.connect(_stop_sessions, weak=False, dispatch_uid="agentq.mcp.stop")
