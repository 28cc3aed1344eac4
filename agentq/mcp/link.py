"""One MCP server's session in a worker process, shared by the server's calls.

The session lives in an owner task on the loop (the SDK's transports are anyio task groups,
entered and left by one task); calls from other tasks send on it. An elicitation names no
call: it is asked on the turn of the one call in flight (docs/mcp.md)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.config import get_settings
from agentq.errors import McpServerUnavailable, McpToolFailed
from agentq.fleet.runtime import get_store
from agentq.mcp.child import ENV_KEYS
from agentq.mcp.listing import ListedTool, cut_description, printable
from agentq.mcp.servers import McpServer
from agentq.models import InteractionRequest

if TYPE_CHECKING:
    from agentq.tools.context import ToolContext

log = logging.getLogger("agentq.mcp")

BACKOFF_S = (0.0, 0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Wait before the next start after 0, 1, 2... failures in a row (the last repeats)."""
STOP_TIMEOUT_S = 10.0
"""Longest wait for a session to close (the SDK closes stdin, waits, then kills the tree)."""

EXPLAIN_CHARS = 500
MAX_TOOLS = 2000
"""A server listing more tools is refused: every request would carry them (endless pages too)."""


def backoff_s(failures: int) -> float:
    return BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside an (anyio) exception group, or `exc` itself."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


def explain(exc: BaseException) -> str:
    """One line for an exception, an anyio group's first leaf included."""
    exc = _leaf(exc)
    text = str(exc) or type(exc).__name__
    # pydantic's errors take several lines, one a link: a log line and a listing take one.
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    text = " ".join(ln for ln in lines if not ln.startswith("For further information"))
    if len(text) > EXPLAIN_CHARS:
        text = text[:EXPLAIN_CHARS] + "..."
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def _is_disconnect(exc: BaseException) -> bool:
    import anyio
    import httpx2
    from mcp.shared.exceptions import MCPError
    from mcp.types import CONNECTION_CLOSED

    exc = _leaf(exc)
    if isinstance(exc, MCPError):
        return exc.code == CONNECTION_CLOSED
    return isinstance(
        exc, (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError, httpx2.TransportError)
    )


class ServerLink:
    """This process's session with one server."""

    def __init__(
        self, server: McpServer, on_list_changed: Callable[[str], None] | None = None
    ) -> None:
        self.server = server
        self.on_list_changed = on_list_changed
        self.failures = 0
        self.last_error = ""
        self.stopped_why = ""
        self._failed_at = 0.0
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._checking: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.reported_ok: bool | None = None
        """What /healthz was last told of this server by this process."""
        self.callers: set[ToolContext] = set()
        """The calls in flight on the session (whose turn an elicitation asks: `_on_elicit`)."""

    @property
    def name(self) -> str:
        return self.server.name

    async def session(self) -> Any:
        """The live session, started (or made again) when there is none."""
        if self._checking is not None:
            # A call just cancelled: the next one waits to learn whether the server is stuck.
            await asyncio.shield(self._checking)
        async with self._lock:
            current = self._session
            if current is not None and not _closed(current):
                return current
            if current is not None:
                self._failed("its connection closed (the server exited)")
                self._begin_stop("its connection closed")
            if self._stopping is not None:
                await asyncio.shield(self._stopping)
            wait_s = self._failed_at + backoff_s(self.failures) - time.monotonic()
            if wait_s > 0:
                raise McpServerUnavailable(
                    self.name,
                    f"{self.last_error}; it failed {self.failures} time(s) in a row, "
                    f"next start in {wait_s:.1f} s",
                )
            try:
                return await self._start()
            except McpServerUnavailable as exc:
                self._failed(exc.detail)
                raise

    async def _start(self) -> Any:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[Any] = loop.create_future()
        stop = asyncio.Event()
        owner = loop.create_task(self._own(ready, stop), name=f"agentq-mcp-{self.name}")
        try:
            session = await asyncio.wait_for(asyncio.shield(ready), self.server.start_timeout_s)
        except asyncio.TimeoutError:
            stop.set()
            ready.cancel()
            owner.cancel()
            raise McpServerUnavailable(
                self.name,
                f"{self.server.describe()} did not answer initialize within "
                f"{self.server.start_timeout_s:g} s",
            ) from None
        except Exception as exc:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(owner, STOP_TIMEOUT_S)
            raise McpServerUnavailable(
                self.name, f"cannot start {self.server.describe()}: {explain(exc)}"
            ) from None
        self._session, self._stop, self._owner = session, stop, owner
        self.stopped_why = ""
        log.info("MCP server %s started (%s)", self.name, self.server.describe())
        return session

    async def _own(self, ready: asyncio.Future[Any], stop: asyncio.Event) -> None:
        """The owner task: enters the transport and the session, holds them until told."""
        from mcp import ClientSession
        from mcp.types import Implementation

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(await self._transport(stack))
                session = await stack.enter_async_context(
                    ClientSession(
                        read,
                        write,
                        message_handler=self._on_message,
                        elicitation_callback=self._on_elicit,
                        client_info=Implementation(name="agentq", version=k.VERSION),
                    )
                )
                await session.initialize()
                if not ready.done():
                    ready.set_result(session)
                await stop.wait()
        except BaseException as exc:  # a cancel too: the task ends with the session
            if not ready.done():
                ready.set_exception(RuntimeError(explain(exc)))
            else:
                log.info("MCP server %s: session ended: %s", self.name, explain(exc))

    async def _transport(self, stack: contextlib.AsyncExitStack) -> Any:
        import httpx2
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        server = self.server
        if server.url is not None:
            timeout = httpx2.Timeout(30.0, read=None)
            http = httpx2.AsyncClient(headers=server.resolved_headers(), timeout=timeout)
            http = await stack.enter_async_context(http)
            return streamable_http_client(server.url, http_client=http)
        assert server.command is not None
        env = {**server.env, ENV_KEYS: ",".join(server.env)}
        # The launcher is agentq's own module: found where this process found agentq.
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        launch = ["-m", "agentq.mcp.child", *server.command]
        params = StdioServerParameters(command=sys.executable, args=launch, env=env, cwd=server.cwd)
        # The process's real stderr: Celery puts a logging proxy, which has no fd, in sys.stderr.
        return stdio_client(params, errlog=sys.__stderr__ or sys.stderr)

    async def _on_message(self, message: Any) -> None:
        method = getattr(getattr(message, "root", message), "method", None)
        if method == "notifications/tools/list_changed" and self.on_list_changed is not None:
            self.on_list_changed(self.name)

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.last_error = why
        self._failed_at = time.monotonic()
        log.warning("MCP server %s failed (%d in a row): %s", self.name, self.failures, why)

    def _begin_stop(self, why: str) -> None:
        """Stop the session in the background; the next `session()` waits for it."""
        stop, owner = self._stop, self._owner
        self._session = self._stop = self._owner = None
        if stop is None or owner is None:
            return
        self.stopped_why = why
        stop.set()

        async def wait() -> None:
            try:
                await asyncio.wait_for(asyncio.shield(owner), STOP_TIMEOUT_S)
            except Exception:
                owner.cancel()
            finally:
                self._stopping = None

        self._stopping = asyncio.get_running_loop().create_task(wait())

    async def stop(self, why: str = "stopped") -> None:
        self._begin_stop(why)
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def list_tools(self) -> list[ListedTool]:
        from mcp.types import PaginatedRequestParams

        session = await self.session()
        out: list[ListedTool] = []
        cursor: str | None = None
        try:
            while True:
                params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
                page = await session.list_tools(params=params)
                out.extend(_listed(t) for t in page.tools)
                if len(out) > MAX_TOOLS:
                    raise ValueError(f"it lists more than {MAX_TOOLS} tools")
                if not page.next_cursor:
                    return out
                if page.next_cursor == cursor:
                    again = printable(page.next_cursor)
                    raise ValueError(f"its listing does not end (cursor {again} again)")
                cursor = page.next_cursor
        except Exception as exc:
            if _is_disconnect(exc):
                self._failed(f"its connection closed while listing tools: {explain(exc)}")
                self._begin_stop("disconnected")
            raise McpServerUnavailable(self.name, f"tools/list failed: {explain(exc)}") from None

    async def _on_elicit(self, context: Any, params: Any) -> Any:
        """The session's elicitation callback: the ElicitResult of the question it asks."""
        from mcp import types

        if not isinstance(params, types.ElicitRequestFormParams) or len(self.callers) != 1:
            why = "not a form" if len(self.callers) == 1 else f"{len(self.callers)} calls in flight"
            log.info("MCP server %s: elicitation declined (%s)", self.name, why)
            return types.ElicitResult(action="decline")
        (caller,) = self.callers
        schema = params.requested_schema
        action, content = await asyncio.to_thread(ask, caller, params.message, schema)
        if action == "accept" and isinstance(content, dict):
            return types.ElicitResult(action="accept", content=content)
        return types.ElicitResult(action="cancel" if action == "cancel" else "decline")

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        on_progress: Callable[[float, float | None, str | None], Awaitable[None]],
        caller: ToolContext | None = None,
    ) -> Any:
        """Call a tool (McpServerUnavailable, McpToolFailed); a question the server asks
        meanwhile goes to `caller`'s turn."""
        session = await self.session()
        if caller is not None:
            self.callers.add(caller)
        try:
            result = await session.call_tool(tool, arguments, progress_callback=on_progress)
        except asyncio.CancelledError:
            self._check_after_cancel(session)
            raise
        except Exception as exc:
            if _is_disconnect(exc) or _closed(session):
                why = self.stopped_why or "its connection closed during the call"
                if self._session is session:
                    self._failed(f"{why} ({explain(exc)})")
                    self._begin_stop("disconnected")
                raise McpServerUnavailable(
                    self.name, f"{why}; the server exited, crashed or cannot be reached"
                ) from None
            self.failures = 0
            raise McpToolFailed(self.name, tool, explain(exc)) from None
        finally:
            if caller is not None:
                self.callers.discard(caller)
        self.failures = 0
        return result

    def _check_after_cancel(self, session: Any) -> None:
        """After a cancel, stop a server stuck in the dropped work (no ping answer in the grace)."""
        grace_s = self.server.cancel_grace_s

        async def check() -> None:
            try:
                await asyncio.wait_for(session.send_ping(), grace_s)
                return
            except Exception as exc:
                why = explain(exc) if not isinstance(exc, asyncio.TimeoutError) else "no answer"
            finally:
                self._checking = None
            if self._session is session:
                msg = "MCP server %s ignored a cancel (ping: %s within %g s): stopping it"
                log.warning(msg, self.name, why, grace_s)
                self._begin_stop(f"it ignored a cancel and was stopped ({why} to a ping)")

        if self._checking is None:
            name = f"agentq-mcp-{self.name}-check"
            self._checking = asyncio.get_running_loop().create_task(check(), name=name)


def _closed(session: Any) -> bool:
    """The SDK's dispatcher knows when the transport closed (the server exited)."""
    return bool(getattr(getattr(session, "_dispatcher", None), "_closed", False))


def _listed(tool: Any) -> ListedTool:
    ann = tool.annotations
    return ListedTool(
        name=tool.name,
        description=cut_description(tool.description or tool.title or ""),
        input_schema=dict(tool.input_schema or {"type": "object"}),
        read_only=ann.read_only_hint if ann is not None else None,
        destructive=ann.destructive_hint if ann is not None else None,
    )


POLL_S = 0.25
"""How often a pending question's record is read while the server waits for it."""
_seq = itertools.count(1)


def ask(caller: ToolContext, message: str, schema: dict[str, Any]) -> tuple[str, Any]:
    """Ask on the caller's turn and wait (blocking): (`accept`, content), `decline` or `cancel`."""
    store = get_store()
    state = store.state(caller.turn_id) or {}
    if state.get("headless") or state.get("status") not in ("running", "queued"):
        return "decline", None
    left_s = None if caller.deadline is None else caller.deadline - time.time()
    timeout_s = get_settings().input_timeout_s
    timeout_s = timeout_s if left_s is None else max(0.001, min(timeout_s, left_s - 1))
    req = InteractionRequest(
        request_id=f"{caller.call_id}.e{next(_seq)}.approval",
        kind="input",
        call_id=caller.call_id,
        tool=caller.tool,
        prompt=message,
        timeout_ms=max(1, int(timeout_s * 1000)),
        answer_schema=schema,
    )
    store.open_interaction(caller.turn_id, req)
    store.bus.publish(caller.turn_id, "interaction_requested", **req.model_dump(), source="mcp")
    rid, until = req.request_id, req.created_at + timeout_s
    while (found := store.interaction(caller.turn_id, rid)) and found[0] == "pending":
        if time.time() < until:
            time.sleep(POLL_S)
        elif store.expire_interaction(caller.turn_id, req) == "timed_out":
            return "cancel", None
        else:
            break  # an answer came first (or the turn ended): it decides
    if store.interaction_decision(caller.turn_id, rid) != "approve":
        return "decline", None
    raw = store.redis.getdel(k.turn_key(caller.turn_id, "secret", rid))
    return "accept", json.loads(raw) if raw is not None else {}
