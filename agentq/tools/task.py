"""The Celery task that runs one tool call in the prefork tool worker, and settles it."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.signals import task_failure
from pydantic import BaseModel

from agentq import constants as k
from agentq.config import get_settings
from agentq.errors import AgentqError
from agentq.models import ToolCall, ToolResult, ToolTaskRequest
from agentq.results import error_result, lost_result, record_for, timeout_result
from agentq.runtime import get_store
from agentq.timing import overran, truncate_text
from agentq.tools.context import Partial, ToolContext
from agentq.tools.registry import ToolSpec, all_tools

log = logging.getLogger("agentq.tools")


class ToolTask(Task):  # type: ignore[misc]
    """Base of every `agentq.tool.<name>` task."""

    acks_late = True
    ignore_result = True
    typing = False
    reject_on_worker_lost = False
    # An idempotent call whose process died is re-run at once, not after Celery's 180 s.
    default_retry_delay = 0


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, default=str, ensure_ascii=False)


def _call(req: ToolTaskRequest) -> ToolCall:
    return ToolCall(id=req.call_id, name=req.tool, arguments="")


def run_call(task: Task, spec: ToolSpec, req: ToolTaskRequest) -> str:
    """Run one call and settle its result; the return value is only for Flower."""
    store = get_store()
    settings = get_settings()
    started = time.time()
    hostname = getattr(task.request, "hostname", None) or "local"
    pid = os.getpid()
    task_id = getattr(task.request, "id", None)
    claim = store.mark_started(
        req.turn_id,
        req.call_id,
        {
            "started_at": started,
            "worker": hostname,
            "pid": pid,
            "task_id": task_id,
            "attempt": req.attempt,
            "delivery": f"{task_id}/{getattr(task.request, 'retries', 0) or 0}",
            # `agentq worker tools` sends heartbeats; a bare `celery worker` does not,
            # and its calls must not be taken for dead for lack of them.
            "heartbeat": os.environ.get("AGENTQ_WORKER_KIND") == "tools",
        },
        {
            "call_id": req.call_id,
            "tool": req.tool,
            "worker": hostname,
            "pid": pid,
            "timeout_s": req.timeout_s,
            "attempt": req.attempt,
        },
    )
    if claim == 0:
        return "already settled: not run again"
    if claim == 2:
        return "delivered again while its first delivery ran: not run again"
    if claim == -2:
        return "its turn is over or gone: not run"
    call = _call(req)
    common: dict[str, Any] = {
        "task_id": task_id,
        "worker": hostname,
        "pid": pid,
        "attempt": req.attempt,
        "budget_s": req.budget_s,
        "timeout_s": req.timeout_s,
        "started_at": started,
    }
    if claim == -1:
        from agentq.results import cancelled_result

        store.settle(req.turn_id, cancelled_result(call, "user", **common))
        return "turn cancelled before start"

    last_progress = [0.0]

    def on_progress(message: str, pct: float | None, fields: dict[str, Any]) -> None:
        now = time.time()
        meta = {
            "call_id": req.call_id,
            "tool": req.tool,
            "message": message,
            "pct": pct,
            "elapsed_ms": int((now - started) * 1000),
            "source": "tool",
            **fields,
        }
        store.bus.publish(req.turn_id, "tool_progress", **meta)
        # Flower shows PROGRESS states; throttled since each is a backend write.
        if now - last_progress[0] >= 0.5:
            last_progress[0] = now
            try:
                task.send_event("task-progress", **meta)
                task.update_state(state="PROGRESS", meta=meta)
            except Exception:
                log.debug("progress not sent to Flower", exc_info=True)

    def read_secret() -> str | None:
        if not req.secret_ref:
            return None
        raw = store.redis.getdel(req.secret_ref)
        return None if raw is None else raw.decode()  # type: ignore[union-attr]

    ctx = ToolContext(
        turn_id=req.turn_id,
        call_id=req.call_id,
        tool=req.tool,
        started_at=started,
        timeout_s=req.timeout_s,
        soft_timeout_s=req.soft_timeout_s,
        is_cancelled=lambda: bool(store.redis.exists(k.cancel_key(req.turn_id))),
        on_progress=on_progress,
        read_secret=read_secret,
        attempt=req.attempt,
    )
    result: ToolResult
    try:
        validated = spec.validate(req.arguments)
        kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
        value = spec.fn(ctx, **kwargs) if spec.wants_ctx else spec.fn(**kwargs)
        finished = time.time()
        partial = isinstance(value, Partial)
        if isinstance(value, Partial):
            value = value.value
        soft = bool(req.soft_timeout_s) and finished - started >= (req.soft_timeout_s or 0)
        text, cut = truncate_text(_render(value), settings.max_result_bytes)
        result = ToolResult(
            call_id=req.call_id,
            tool=req.tool,
            status="ok",
            content=text,
            truncated_bytes=cut,
            record=record_for(
                call,
                "ok",
                finished_at=finished,
                soft_limited=soft,
                partial=partial or soft,
                overran=overran(finished - started, req.budget_s),
                **common,
            ),
        )
    except SoftTimeLimitExceeded:
        rest = {k_: v for k_, v in common.items() if k_ != "timeout_s"}
        result = timeout_result(call, req.timeout_s, killed=False, soft=True, **rest)
    except AgentqError as exc:
        result = error_result(call, exc.message, **common)
    except Exception as exc:
        result = error_result(call, f"{req.tool} raised {type(exc).__name__}: {exc}", **common)
    if result.status != "ok":
        result.record.overran = overran(time.time() - started, req.budget_s)
    store.settle(req.turn_id, result)
    return result.status


def _on_task_failure(
    sender: Task | None = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    kwargs: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """In the worker's parent process: settle calls whose process was killed or died."""
    name = getattr(sender, "name", "") or ""
    if not name.startswith(k.TOOL_TASK_PREFIX) or not kwargs:
        return
    if not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    try:
        req = ToolTaskRequest.model_validate(kwargs)
    except Exception:
        log.exception("cannot settle task %s: bad kwargs", task_id)
        return
    store = get_store()
    start = json.loads(store.redis.hget(k.started_key(req.turn_id), req.call_id) or "{}")
    common: dict[str, Any] = {
        "task_id": task_id,
        "worker": start.get("worker"),
        "pid": start.get("pid"),
        "attempt": req.attempt,
        "budget_s": req.budget_s,
        "started_at": start.get("started_at"),
    }
    call = _call(req)
    if isinstance(exception, TimeLimitExceeded):
        result = timeout_result(call, req.timeout_s, killed=True, **common)
    else:
        result = lost_result(
            call, f"its worker process died ({exception})", timeout_s=req.timeout_s, **common
        )
    store.settle(req.turn_id, result)


def register_tool_tasks(app: Celery, specs: dict[str, ToolSpec] | None = None) -> list[str]:
    """Register one task per tool on `app`; return the queues the tools run on."""
    queues: set[str] = {k.QUEUE_TOOLS}
    for spec in (specs or all_tools()).values():
        queues.add(spec.policy.queue)
        if spec.task_name in app.tasks:
            continue

        def make(s: ToolSpec) -> Any:
            def run(self: Task, **kwargs: Any) -> str:
                return run_call(self, s, ToolTaskRequest.model_validate(kwargs))

            run.__name__ = f"tool_{s.name}"
            run.__doc__ = s.description
            return run

        app.task(
            name=spec.task_name,
            bind=True,
            base=ToolTask,
            queue=spec.policy.queue,
            retry_on_worker_lost=spec.policy.idempotent,
            max_retries=spec.policy.max_retries,
        )(make(spec))
    task_failure.connect(_on_task_failure, weak=False, dispatch_uid="agentq.tool.failure")
    return sorted(queues)
