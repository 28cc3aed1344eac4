"""How `agentq worker io` runs a call: a coroutine on the process's event loop.

The Celery task (a thread of the `threads` pool) only hands the call to the loop and
returns, so one process holds thousands of calls with a handful of threads; the
message is acknowledged at hand-off. If the process dies, its heartbeat stops and the
turn settles its calls as `lost` (an idempotent tool may be sent again).

Limits, as for sync tools: at the soft limit the tool's coroutine is cancelled with
SOFT_LIMIT_MESSAGE (`ctx.soft_limited` is true); catching `asyncio.CancelledError`
and returning `Partial(...)` keeps what it has, otherwise the call settles `timeout`.
At the hard limit it is cancelled and settles `timeout` at once; an abort (the cancel
channel) cancels it and settles `cancelled`. A sync tool declared `thread=True` runs
on a thread: its soft limit only sets `ctx.soft_limited`, and at its hard limit the
call settles `timeout` while the thread, which cannot be stopped, is abandoned.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any

from celery import Task

from agentq.aio.host import LoopHost, Running, get_host
from agentq.models import ToolResult, ToolTaskRequest
from agentq.state.held import HOLD_RETRY_S, held_writes
from agentq.telemetry import context as log_context
from agentq.telemetry import logs, tracing
from agentq.tools.calls import (
    CallScope,
    call_kwargs,
    check_value,
    mark_started,
    ok_result,
    progress_fields,
    raised_result,
    secret_reader,
    settle,
    tick_fields,
)
from agentq.tools.context import ToolContext
from agentq.tools.registry import ToolSpec
from agentq.tools.results import cancelled_result, lost_result, timeout_result

log = logging.getLogger("agentq.tools")

SOFT_LIMIT_MESSAGE = "agentq: soft time limit"
"""The message of the CancelledError an async tool sees at its soft limit."""
FLOWER_PROGRESS_S = 0.5
"""A call's progress reaches Flower (a PROGRESS state in the result backend, five Redis
commands) at most this often, and only once the call has run this long: most async calls
end sooner, and Flower is for watching the long ones."""


def submit_call(task: Task, spec: ToolSpec, req: ToolTaskRequest) -> str:
    """In a Celery thread: hand the call to the loop (waiting while it is full)."""
    host = get_host()
    # Results wait here for Redis: no new call until they are written (the wait is short
    # once Redis answers, and bounded by their deadlines when it does not).
    while held_writes.count and not held_writes.wait_none(HOLD_RETRY_S):
        pass
    request = task.request
    host.hostname = host.hostname or (getattr(request, "hostname", None) or "")
    task_id = getattr(request, "id", None)
    scope = CallScope(
        req=req, worker=getattr(request, "hostname", None) or "local", task_id=task_id
    )
    delivery = f"{task_id}/{getattr(request, 'retries', 0) or 0}"
    host.loop.submit(lambda: _guarded(host, spec, scope, delivery, task.backend))
    return "handed to the event loop"


async def _guarded(
    host: LoopHost, spec: ToolSpec, scope: CallScope, delivery: str, backend: Any
) -> None:
    try:
        await run_async_call(host, spec, scope, delivery, backend)
    except BaseException:
        log.exception("call %s of %s failed outside the tool", scope.req.call_id, spec.name)
        raise


async def run_async_call(
    host: LoopHost, spec: ToolSpec, scope: CallScope, delivery: str, backend: Any = None
) -> str:
    if not (tracing.enabled or logs.enabled):
        return await _run_async_call(host, spec, scope, delivery, backend)
    # Bound in this call's own asyncio task: the other calls on the loop keep theirs.
    req = scope.req
    bound = log_context.bind(req.turn_id, req.call_id, scope.task_id)
    span = tracing.start_span(
        tracing.CALL_SPAN_PREFIX + req.tool,
        req.traceparent,
        tracing.call_attributes(req, scope.task_id),
    )
    status = "error"
    try:
        with tracing.active(span):
            status = await _run_async_call(host, spec, scope, delivery, backend)
        return status
    finally:
        log_context.unbind(bound)
        tracing.end_span(span, status)


async def _run_async_call(
    host: LoopHost, spec: ToolSpec, scope: CallScope, delivery: str, backend: Any = None
) -> str:
    req = scope.req
    store = host.store
    settings = host.settings
    scope.started = time.time()
    why_not = await host.io(mark_started, store, scope, delivery, within_limit=True)
    if why_not is not None:
        log.info("call %s of %s: %s", req.call_id, spec.name, why_not)
        return why_not
    loop = asyncio.get_running_loop()
    aborted = threading.Event()
    abort_wait = asyncio.Event()
    soft_fired = [False]
    last_flower = [time.monotonic()]

    def on_progress(message: str, pct: float | None, fields: dict[str, Any]) -> None:
        meta = progress_fields(scope, message, pct, fields)
        host.fire(store.bus.publish, req.turn_id, "tool_progress", **meta)
        now = time.monotonic()
        if backend is not None and scope.task_id and now - last_flower[0] >= FLOWER_PROGRESS_S:
            last_flower[0] = now
            host.fire(backend.store_result, scope.task_id, meta, "PROGRESS")

    ctx = ToolContext(
        turn_id=req.turn_id,
        call_id=req.call_id,
        tool=req.tool,
        started_at=scope.started,
        timeout_s=req.timeout_s,
        soft_timeout_s=req.soft_timeout_s,
        is_cancelled=aborted.is_set,
        on_progress=on_progress,
        read_secret=secret_reader(store, req),
        attempt=req.attempt,
    )
    name = f"{spec.task_name}:{req.call_id}"
    try:
        kwargs = call_kwargs(spec, req)
    except Exception as exc:
        await host.io(settle, store, scope, raised_result(scope, exc))
        return "error"

    def on_abort() -> None:
        aborted.set()
        ctx._cancelled = True
        abort_wait.set()

    inner: asyncio.Future[Any]
    if spec.kind == "thread":
        fn = (
            functools.partial(spec.fn, ctx, **kwargs)
            if spec.wants_ctx
            else functools.partial(spec.fn, **kwargs)
        )
        inner = loop.run_in_executor(host.threads, fn)
    else:
        try:
            made = spec.fn(ctx, **kwargs) if spec.wants_ctx else spec.fn(**kwargs)
        except Exception as exc:
            await host.io(settle, store, scope, raised_result(scope, exc))
            return "error"
        inner = loop.create_task(_await(made), name=name)
    settled = threading.Lock()
    done_flag = [False]

    def settle_sync(result: ToolResult) -> bool:
        with settled:
            if done_flag[0]:
                return False
            done_flag[0] = True
        settle(store, scope, result)
        return True

    def on_recycle(why: str, blocked: bool) -> None:
        if blocked:
            settle_sync(
                timeout_result(
                    scope.call,
                    req.timeout_s,
                    killed=True,
                    what=f"Tool {req.tool!r}: {why}.",
                    **scope.without_timeout,
                )
            )
        else:
            settle_sync(lost_result(scope.call, why, **scope.common))

    host.running[name] = Running(req.turn_id, f"call {req.call_id} of tool {req.tool}", on_recycle)
    remove_cancel = host.cancels.add(req.turn_id, on_abort)
    ticker = loop.create_task(_tick(host, scope, settings.progress_interval_s))
    soft_timer = None
    if req.soft_timeout_s and spec.kind == "async":

        def soft() -> None:
            if not inner.done():
                soft_fired[0] = True
                inner.cancel(SOFT_LIMIT_MESSAGE)

        soft_timer = loop.call_later(max(0.0, req.soft_timeout_s - _elapsed(scope)), soft)
    hard_left = max(0.0, req.timeout_s - _elapsed(scope)) if req.timeout_s > 0 else None
    if hard_left is not None:
        host.loop.watch(name, time.monotonic() + hard_left)
    waiter = loop.create_task(abort_wait.wait())
    try:
        done, _ = await asyncio.wait(
            {inner, waiter}, timeout=hard_left, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        host.loop.unwatch(name)
        remove_cancel()
        ticker.cancel()
        waiter.cancel()
        if soft_timer is not None:
            soft_timer.cancel()
    if inner in done:
        result = _outcome(spec, scope, inner, soft_fired[0], aborted.is_set(), host)
    elif waiter in done:
        inner.cancel()
        result = cancelled_result(scope.call, "user", **scope.common)
    else:
        inner.cancel()
        what = (
            f"Tool {req.tool!r} was cancelled at its hard time limit of {req.timeout_s:g}s; "
            "it is not running any more."
            if spec.kind == "async"
            else f"Tool {req.tool!r} did not finish within its hard time limit of "
            f"{req.timeout_s:g}s; its thread was abandoned and may still be running."
        )
        result = timeout_result(
            scope.call, req.timeout_s, killed=True, what=what, **scope.without_timeout
        )
    if not inner.done():
        inner.add_done_callback(_forget)
    host.running.pop(name, None)
    with settled:
        if done_flag[0]:
            return result.status
        done_flag[0] = True
    await host.io(settle, store, scope, result)
    return result.status


def _outcome(
    spec: ToolSpec,
    scope: CallScope,
    inner: asyncio.Future[Any],
    soft_fired: bool,
    aborted: bool,
    host: LoopHost,
) -> ToolResult:
    req = scope.req
    if inner.cancelled():
        if aborted:
            return cancelled_result(scope.call, "user", **scope.common)
        if soft_fired:
            return timeout_result(
                scope.call, req.timeout_s, killed=False, soft=True, **scope.without_timeout
            )
        return raised_result(scope, RuntimeError("the tool's coroutine was cancelled"))
    exc = inner.exception()
    if exc is not None:
        return raised_result(scope, exc)
    try:
        return ok_result(
            scope, check_value(spec, inner.result()), host.settings, soft_fired=soft_fired
        )
    except Exception as err:
        return raised_result(scope, err)


async def _await(made: Any) -> Any:
    """Await what an async tool made; a non-awaitable (a wrapper's value) is the result."""
    if asyncio.iscoroutine(made) or asyncio.isfuture(made) or hasattr(made, "__await__"):
        return await made
    return made


async def _tick(host: LoopHost, scope: CallScope, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        if held_writes.count:
            continue  # Redis is away: a tick would wait in the store's threads before results
        host.fire(host.store.bus.publish, scope.req.turn_id, "tool_progress", **tick_fields(scope))


def _elapsed(scope: CallScope) -> float:
    return time.time() - scope.started


def _forget(fut: asyncio.Future[Any]) -> None:
    """Retrieve the late end of a call already settled, so asyncio does not log it."""
    if not fut.cancelled():
        fut.exception()
