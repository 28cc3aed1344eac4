"""How `agentq worker io` runs a call: its Celery task hands it to the event loop (and its
message is acknowledged), so a handful of threads hold thousands of calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from celery import Task

from agentq.aio.host import LoopHost, Running, get_host
from agentq.models import ToolResult, ToolTaskRequest
from agentq.state.held import HOLD_RETRY_S, held_writes
from agentq.telemetry import tracing
from agentq.tools import calls
from agentq.tools.context import ToolContext
from agentq.tools.registry import ToolSpec
from agentq.tools.results import lost_result

log = logging.getLogger("agentq.tools")


def submit_call(task: Task, spec: ToolSpec, req: ToolTaskRequest) -> str:
    """In a Celery thread: hand the call to the loop (waiting while it is full)."""
    host = get_host()
    # No new call while results wait for Redis (bounded by their deadlines).
    while held_writes.count and not held_writes.wait_none(HOLD_RETRY_S):
        pass
    scope, delivery = calls.task_scope(task.request, req)
    host.loop.submit(lambda: _guarded(host, spec, scope, delivery, task.backend))
    return "handed to the event loop"


async def _guarded(
    host: LoopHost, spec: ToolSpec, scope: calls.CallScope, delivery: str, backend: Any
) -> None:
    """Run and settle the call in its own asyncio task, so its log ids and span are its own."""
    try:
        with calls.observed(scope) as span:
            call = _AsyncCall(host, spec, scope, backend)
            status = await host.io(
                calls.mark_started, host.store, scope, delivery, within_limit=True
            )
            if status is not None:
                log.info("call %s of %s: %s", scope.req.call_id, spec.name, status)
            else:
                result = await call.wait()
                if call.settling.acquire(blocking=False):  # else the worker's recycling did
                    await host.io(calls.settle, host.store, scope, result)
                status = result.status
        tracing.end_span(span, status)
    except BaseException:
        log.exception("call %s of %s failed outside the tool", scope.req.call_id, spec.name)
        raise


class _AsyncCall:
    """One call on the loop, settled once however it ends (itself, its hard limit, an abort,
    or the worker recycling it)."""

    def __init__(
        self, host: LoopHost, spec: ToolSpec, scope: calls.CallScope, backend: Any
    ) -> None:
        self.host, self.spec, self.scope = host, spec, scope
        scope.started = time.time()
        req = self.req = scope.req
        self.name = f"{spec.task_name}:{req.call_id}"
        self.aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.settling = threading.Lock()
        """Taken, never released, by whoever settles the call: the first to try, alone."""
        self.ctx = calls.tool_context(host.store, scope, backend, host.pool.submit, watched=True)

    def _abort(self) -> None:
        self.ctx._cancelled = True
        if not self.aborted.done():
            self.aborted.set_result(None)

    def _recycled(self, why: str, blocked: bool) -> None:
        scope, req = self.scope, self.req
        if blocked:
            result = scope.timeout(killed=True, what=f"Tool {req.tool!r}: {why}.")
        else:
            result = lost_result(scope.call, why, **scope.common)
        if self.settling.acquire(blocking=False):
            calls.settle(self.host.store, scope, result)

    def _soft(self, inner: asyncio.Future[Any]) -> None:
        if not inner.done():
            self.scope.soft_fired = True
            inner.cancel("agentq: soft time limit")  # what the tool's CancelledError says

    async def wait(self) -> ToolResult | calls.Waiting:
        """Run the tool (on the loop, or a pool thread) until it ends, times out or is aborted."""
        host, scope, req = self.host, self.scope, self.req
        loop = asyncio.get_running_loop()
        if self.spec.kind == "thread":
            inner = loop.run_in_executor(host.threads, calls.invoke, self.spec, self.ctx, req)
        else:
            inner = loop.create_task(_await(self.spec, self.ctx, req), name=self.name)
        ids = {"tool": req.tool, "call_id": req.call_id}
        what = f"call {req.call_id} of tool {req.tool}"
        host.running[self.name] = Running(req.turn_id, what, self._recycled, ids)
        with contextlib.ExitStack() as undo:
            undo.callback(host.cancels.add(req.turn_id, self._abort))
            ticker = loop.create_task(_tick(host, scope, host.settings.progress_interval_s))
            undo.callback(ticker.cancel)
            if req.soft_timeout_s and self.spec.kind == "async":
                soft_left = max(0.0, req.soft_timeout_s - (time.time() - scope.started))
                undo.callback(loop.call_later(soft_left, self._soft, inner).cancel)
            hard_left = None
            if req.timeout_s > 0:
                hard_left = max(0.0, req.timeout_s - (time.time() - scope.started))
                host.loop.watch(self.name, time.monotonic() + hard_left)
                undo.callback(host.loop.unwatch, self.name)
            done, _ = await asyncio.wait(
                {inner, self.aborted}, timeout=hard_left, return_when=asyncio.FIRST_COMPLETED
            )
        value: Any = None
        raised: BaseException | None = None
        if inner in done:
            try:
                value = inner.result()
            except (Exception, asyncio.CancelledError) as exc:  # the soft limit's among them
                raised = exc
        else:
            inner.cancel()
            # Its late end is retrieved, so asyncio does not log it.
            inner.add_done_callback(lambda late: late.cancelled() or late.exception())
        host.running.pop(self.name, None)
        hard_limit = None
        if not done:
            hard_limit = (
                f"Tool {req.tool!r} was cancelled at its hard time limit of "
                f"{req.timeout_s:g}s; it is not running any more."
                if self.spec.kind == "async"
                else f"Tool {req.tool!r} did not finish within its hard time limit of "
                f"{req.timeout_s:g}s; its thread was abandoned and may still be running."
            )
        return calls.outcome(
            scope,
            self.spec,
            host.settings,
            aborted=self.ctx._cancelled,
            hard_limit=hard_limit,
            raised=raised,
            value=value,
        )


async def _await(spec: ToolSpec, ctx: ToolContext, req: ToolTaskRequest) -> Any:
    """Run an async tool; a non-awaitable it made (a wrapper's value) is the result."""
    made = calls.invoke(spec, ctx, req)
    if asyncio.iscoroutine(made) or asyncio.isfuture(made) or hasattr(made, "__await__"):
        return await made
    return made


async def _tick(host: LoopHost, scope: calls.CallScope, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        if held_writes.count:
            continue  # Redis is away: a tick would wait in the store's threads before results
        host.pool.submit(calls.tick, host.store, scope)
