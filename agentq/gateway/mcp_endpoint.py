"""`/mcp`: the fleet's agents as MCP tools (Streamable HTTP), each call a turn (docs/mcp.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from agentq.agents import published_agent_details
from agentq.constants import VERSION
from agentq.errors import AgentqError, TurnNotFound
from agentq.events import Event
from agentq.events.follow import follow
from agentq.gateway.errors import invalid
from agentq.gateway.sse import stepped
from agentq.gateway.validate import client_host
from agentq.models import TurnHandle, TurnRequest

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Gateway

log = logging.getLogger("agentq.gateway")

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The task for the agent."}},
    "required": ["input"],
}
TURN_META_KEY = "io.agentq/turn_id"
"""The `_meta` key of a call's result that names its turn."""
FOLLOW_HEARTBEAT_S = 1.0
"""How often the follow loop wakes without events, so a cancel is seen within it."""


PROGRESS = {  # what an MCP client is told of each turn event worth a notification
    "turn_started": "turn {turn_id} started",
    "turn_queued": "queued behind another turn",
    "llm_started": "thinking (model round {round})",
    "tool_started": "calling {tool}",
    "tool_progress": "{tool}: {message}",
    "tool_finished": "{tool}: {status}",
    "interaction_requested": "waiting for an answer ({kind})",
}


def progress_message(ev: Event, started: float) -> str | None:
    """The notification of one turn event, or None."""
    f = ev.fields
    template = PROGRESS.get(ev.type)
    if ev.type == "tool_progress" and not (f.get("source") == "tool" and f.get("message")):
        return None  # a sub-agent's relayed progress, or one without words
    if template is None:
        return None
    words = defaultdict(lambda: None, {"round": "?", "kind": "approval", **f})
    words["turn_id"] = ev.turn_id
    return f"[{max(0.0, ev.ts - started):.1f} s] " + template.format_map(words)


def check_transport(method: str, headers: Any, session_id: str | None) -> None:
    """Refuse (422, as any bad request) what no MCP session can take."""
    if method == "POST":
        if "application/json" not in headers.get("content-type", ""):
            raise invalid("Content-Type: application/json required")
        accept = headers.get("accept", "")
        if not ("application/json" in accept and "text/event-stream" in accept):
            raise invalid("Accept: application/json, text/event-stream required")
    elif session_id is None:
        raise invalid("Mcp-Session-Id required: POST an initialize request first")


def result_of(terminal: Event) -> Any:
    from mcp.types import CallToolResult, TextContent

    f = terminal.fields
    if terminal.type == "turn_finished":
        output = f.get("output")
        text = str(f.get("content") or "") or ("" if output is None else json.dumps(output))
        return CallToolResult(
            content=[TextContent(type="text", text=text)], structured_content=output
        )
    if terminal.type == "turn_error":
        code = f.get("code") or "error"
        return _error(f"turn {terminal.turn_id} failed ({code}): {f.get('error') or 'no detail'}")
    return _error(f"turn {terminal.turn_id} was aborted ({f.get('reason') or 'user'})")


def _error(message: str) -> Any:
    from mcp.types import CallToolResult, TextContent

    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


class McpEndpoint:
    def __init__(self, gw: Gateway) -> None:
        from mcp.server.lowlevel import Server
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.server.transport_security import TransportSecuritySettings

        self.gw = gw
        self.server: Any = Server(
            "agentq",
            version=VERSION,
            description="The agents of an agentq fleet: each call is a durable, observable turn.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # The gateway's RequestGuard checks Host and Origin for every path already.
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken

        request = Request(scope, receive)
        principal = self.gw.require(request, "key")
        check_transport(request.method, request.headers, request.headers.get("mcp-session-id"))
        if principal is not None:
            # The SDK binds a session to the user that made it: to anyone else it is
            # unknown (404), as someone else's turn is.
            user = AuthenticatedUser(AccessToken(token="", client_id=principal.name, scopes=[]))
            scope = {**scope, "user": user}
        await self.manager.asgi_app(scope, receive, send)

    async def _list_tools(self, ctx: Any, params: Any) -> Any:
        from mcp.types import ListToolsResult, Tool

        agents = await run_in_threadpool(published_agent_details, self.gw.client._store.redis)
        tools = [
            Tool(
                name=a["name"],
                description=a.get("description")
                or f"Run the {a['name']} agent of this agentq fleet (a turn, with its tools).",
                input_schema=INPUT_SCHEMA,
                output_schema=a.get("output_schema"),
            )
            for a in agents
        ]
        return ListToolsResult(tools=tools)

    async def _call_tool(self, ctx: Any, params: Any) -> Any:
        request: Request = ctx.request
        principal = self.gw.require(request, "key")
        host = client_host(request)
        prompt = (params.arguments or {}).get("input")
        if not isinstance(prompt, str) or not prompt.strip():
            return _error('expected {"input": "<the task, a non-empty string>"}')
        req = TurnRequest(prompt=prompt, agent=params.name, headless=True, detach=True)
        try:
            handle = await run_in_threadpool(self.gw.start_limited, req, principal, host)
        except AgentqError as exc:
            return _error(exc.message)
        try:
            terminal = await self._follow(ctx, handle)
        except BaseException:
            # The client cancelled the request (notifications/cancelled) or went away.
            with anyio.CancelScope(shield=True), contextlib.suppress(TurnNotFound):
                await run_in_threadpool(self.gw.client.abort, handle.turn_id, handle.token)
                log.info("mcp: turn %s aborted: its call was cancelled", handle.turn_id)
            raise
        result = result_of(terminal)
        result.meta = {TURN_META_KEY: handle.turn_id}
        return result

    async def _follow(self, ctx: Any, handle: TurnHandle) -> Event:
        events = follow(self.gw.client._store.bus, handle.turn_id, heartbeat_s=FOLLOW_HEARTBEAT_S)
        started = time.time()
        sent = 0
        # Abandoned when cancelled: a follow still waiting in Redis must not hold the loop
        # (a step still running in an abandoned thread closes the follow as it returns).
        async with aclosing(stepped(events, abandon_on_cancel=True)) as items:
            async for ev in items:
                if ev is None:
                    continue
                if ev.ends_turn:
                    return ev
                if ev.type == "turn_started":
                    started = ev.ts
                message = progress_message(ev, started)
                if message is not None and not ev.path:
                    sent += 1
                    await ctx.session.report_progress(sent, None, message)
        raise RuntimeError(f"the events of turn {handle.turn_id} ended early")
