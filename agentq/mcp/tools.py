"""An MCP server's tool as an agentq tool: its spec and its call, an `async def` tool on
`agentq worker io` like any other (its limits, ticks, abort and one settled result)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentq import constants as k
from agentq.aio import cancel
from agentq.errors import McpServerUnavailable, McpToolFailed, ToolArgumentsInvalid
from agentq.fleet.runtime import get_store
from agentq.limits.semaphore import LeasedSemaphore
from agentq.mcp.link import ServerLink
from agentq.mcp.listing import ListedTool, record_health, tool_name
from agentq.mcp.servers import McpServer
from agentq.tools.context import ToolContext
from agentq.tools.policy import Approval, ToolPolicy
from agentq.tools.registry import ToolSpec

log = logging.getLogger("agentq.mcp")

SLOT_UNLIMITED_S = 3600.0
"""How long a slot of a call without a hard limit is held if its worker dies with it."""


class McpArguments(BaseModel):
    """The arguments of an MCP tool's call, as its JSON schema accepted them."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True)
class McpToolSpec(ToolSpec):
    """A tool of an MCP server (`mcp_server`), named `SERVER__TOOL` to the model."""

    _validator: Any = field(default=None, compare=False, repr=False)

    def validate(self, arguments: dict[str, Any]) -> BaseModel:
        """Check the arguments against the tool's input schema, before anything is sent."""
        from jsonschema import exceptions

        error = exceptions.best_match(self._validator.iter_errors(arguments))
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path) or "(arguments)"
            raise ToolArgumentsInvalid(self.name, f"{where}: {error.message}")
        return McpArguments.model_validate(arguments)


def approval_of(server: McpServer, listed: ListedTool) -> Approval:
    """`annotations`: ask unless the tool says it only reads, and the server is trusted."""
    if server.approval != "annotations":
        return server.approval
    return "auto" if server.trust_annotations and listed.read_only is True else "ask"


def make_spec(link: ServerLink, listed: ListedTool) -> McpToolSpec:
    from jsonschema.validators import validator_for

    server = link.server
    schema = listed.input_schema  # JSON Schema of an object: the listing refused the others
    approval = approval_of(server, listed)
    confirm = approval == "ask" and server.trust_annotations and listed.destructive
    policy = ToolPolicy.model_validate(
        {
            "timeout_s": server.timeout_s,
            "budget_s": server.budget_s,
            "concurrency": "exclusive" if server.concurrency == "exclusive" else "parallel",
            "approval": approval,
            "approval_kind": "confirm" if confirm else "approval",
            "queue": server.queue,
        }
    )
    remote = listed.name
    return McpToolSpec(
        name=tool_name(server.name, remote),
        fn=functools.partial(call_tool, link, remote),
        description=listed.description or f"{remote} (MCP server {server.name})",
        declared=policy,
        args_model=McpArguments,
        wants_ctx=True,
        schema=schema,
        kind="async",
        mcp_server=server.name,
        _validator=validator_for(schema)(schema),
    )


async def call_tool(link: ServerLink, remote: str, ctx: ToolContext, /, **arguments: Any) -> Any:
    """One call on the server's session, in its slot (positional-only: any argument is free)."""

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        pct = round(100.0 * progress / total, 1) if total else None
        ctx.progress(message or "", pct=pct, progress=progress, total=total)

    async with _slot(link.server, ctx):
        try:
            result = await link.call(remote, arguments, on_progress, ctx)
        except McpServerUnavailable as exc:
            _report(link, ok=False, error=exc.detail)
            raise
    if link.reported_ok is not True:
        _report(link, ok=True, error="")
    if result.is_error:
        raise McpToolFailed(link.name, remote, content_text(result.content) or "isError, no text")
    if result.structured_content is not None:
        return result.structured_content
    return content_text(result.content)


def content_text(blocks: list[Any]) -> str:
    """What the model reads of a result's content: the text, a line for each other block."""
    parts = []
    for block in blocks:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            parts.append(text if text is not None else f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
        else:
            mime = getattr(block, "mime_type", "") or kind
            parts.append(f"[{kind} content, {mime}]")
    return "\n".join(parts)


@contextlib.asynccontextmanager
async def _slot(server: McpServer, ctx: ToolContext) -> AsyncIterator[None]:
    """Hold one of the server's fleet-wide slots (`concurrency: N`) for the call."""
    limit = server.concurrency
    if not isinstance(limit, int):
        yield
        return
    watch = cancel.CancelWatch.current
    assert watch is not None, "an MCP call runs on an I/O worker's loop"
    slots = LeasedSemaphore(get_store().redis, limit)
    loop = asyncio.get_running_loop()
    key = k.mcp_slots_key(server.name)
    # Leased past the call's hard limit: a worker that dies with the call frees it then.
    lease_s = (ctx.timeout_s or SLOT_UNLIMITED_S) + 5.0
    release = functools.partial(slots.release, key, ctx.call_id, wake=True)
    for tries in itertools.count():
        # Woken by a place given back, the soonest lease's end, or POLL_S if a message is lost.
        freed = watch.on_freed(key)
        trying = loop.run_in_executor(None, slots.acquire_or_wait_ms, key, ctx.call_id, lease_s)
        try:
            wait_ms = await asyncio.shield(trying)
            if not wait_ms:
                break
            if not tries:
                ctx.progress(f"waiting for one of {limit} slots of MCP server {server.name}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed, min(wait_ms / 1000, cancel.POLL_S))
        except asyncio.CancelledError:
            # Cancelled mid-try: a place the try takes is given back, not held to its lease's end.
            if await asyncio.shield(trying) == 0:
                await asyncio.shield(loop.run_in_executor(None, release))
            raise
        finally:
            freed.cancel()
    try:
        yield
    finally:
        # Shielded: a second cancel of the call stops the wait, never the release.
        await asyncio.shield(loop.run_in_executor(None, release))


def _report(link: ServerLink, *, ok: bool, error: str) -> None:
    """How the server's last start went, for /healthz and the console (never its headers)."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    try:
        redis = get_store().redis
        asyncio.get_running_loop().run_in_executor(
            None, record_health, redis, link.name, ok, link.failures, error, worker
        )
        link.reported_ok = ok
    except Exception:
        log.debug("MCP health not recorded", exc_info=True)
