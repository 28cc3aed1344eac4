"""What an I/O worker does for its MCP servers beyond running calls: the tasks of tools a
listing adds while it runs (it reads no registry, so it looks for new listings on a thread
of its own), and its sessions stopped (stdio servers with them) when it goes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from agentq.fleet.roles import current_role
from agentq.mcp.catalog import POLL_S, McpTools, loaded
from agentq.tools.registry import ToolSpec

log = logging.getLogger("agentq.mcp")

STOP_TIMEOUT_S = 15.0


Register = Callable[[dict[str, ToolSpec]], Any]
_register: Register | None = None
_stopping = threading.Event()


def _register_added_tools(sender: Any = None, **_: Any) -> None:
    """A tool a server adds later (`tools/list_changed`) gets its task on this worker too:
    registered, and the consumer told, or its calls would be refused as unknown tasks."""
    tools = loaded()
    if tools is None or current_role() != "io" or _register is None:
        return
    consumer = sender
    register = _register

    def added(specs: list[ToolSpec]) -> None:
        register({s.name: s for s in specs})
        update = getattr(consumer, "update_strategies", None)
        if callable(update):
            update()
        log.info("MCP tools added: %s", ", ".join(s.name for s in specs))

    tools.on_new_tools = added
    threading.Thread(
        target=_watch_listings, args=(tools, _stopping), name="agentq-mcp-listings", daemon=True
    ).start()


def _watch_listings(tools: McpTools, stop: threading.Event) -> None:
    """Apply the listings other processes share (a server's tools listed again past their
    TTL, or one this worker could not list at start): a call of a tool whose task this
    worker lacks would be dropped as an unknown task."""
    while not stop.wait(POLL_S):
        tools.refresh()


def _stop_sessions(**_: Any) -> None:
    """Close every MCP session on the loop: a stdio server is told (stdin closed), then
    killed if it lingers. (A worker killed outright takes them along: agentq.mcp.child.)"""
    tools = loaded()
    if tools is None or current_role() != "io":
        return
    _stopping.set()
    from agentq.aio import host as aio_host

    host = aio_host._host
    if host is None:
        return
    try:
        host.loop.submit(tools.close).result(STOP_TIMEOUT_S)
    except Exception:
        log.warning("MCP sessions not all stopped in time", exc_info=True)


def connect(register: Register) -> None:
    """Connect the signals; the worker does it after its own, so a warm shutdown lets the
    calls on the loop end before their sessions stop. `register` registers tools' tasks."""
    global _register
    _register = register
    worker_ready.connect(_register_added_tools, weak=False, dispatch_uid="agentq.mcp.added")
    worker_shutdown.connect(_stop_sessions, weak=False, dispatch_uid="agentq.mcp.stop")
