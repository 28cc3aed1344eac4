"""JSON logs (`AGENTQ_LOG_FORMAT=json`): one JSON object a line, with the turn, call and
Celery task a line is about.

Workers switch it on from Celery's logging signals (so a bare `celery worker` gets it
too), the gateway from its app factory. The step, the tool task and the model round bind
their ids (`bind`) only while JSON logs or tracing are on: the hot path pays nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from contextvars import ContextVar, Token
from typing import Any, NamedTuple

enabled = False
"""True once JSON logs are on in this process: the step, call and round bind their ids."""


class LogContext(NamedTuple):
    turn_id: str | None = None
    call_id: str | None = None
    task_id: str | None = None


_EMPTY = LogContext()
_current: ContextVar[LogContext] = ContextVar("agentq_log_context", default=_EMPTY)


def celery_task() -> tuple[str | None, str | None]:
    """The id and name of this thread's Celery task, without importing Celery."""
    state = sys.modules.get("celery._state")
    task = state.get_current_task() if state is not None else None
    if task is None or task.request is None:
        return None, None
    return getattr(task.request, "id", None), getattr(task, "name", None)


def bind(
    turn_id: str | None, call_id: str | None = None, task_id: str | None = None
) -> Token[LogContext]:
    """Make the ids current (in this thread, or this asyncio task); undo with `unbind`."""
    return _current.set(LogContext(turn_id, call_id, task_id))


def unbind(token: Token[LogContext]) -> None:
    _current.reset(token)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        ctx = _current.get()
        task_id, task_name = celery_task()
        # The bound id wins: on an event loop the Celery task that handed a call over is gone.
        ids = {
            "turn_id": ctx.turn_id,
            "call_id": ctx.call_id,
            "task_id": ctx.task_id or task_id,
            "task_name": task_name,
        }
        out.update({k: v for k, v in ids.items() if v is not None})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def install(log_format: str) -> bool:
    """Give every handler the JSON formatter if `log_format` is "json"; True if it did."""
    global enabled
    if log_format != "json":
        return False
    enabled = True
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    known = list(logging.Logger.manager.loggerDict.values())
    formatter = JsonFormatter()
    for logger in (root, *(x for x in known if isinstance(x, logging.Logger))):
        for handler in logger.handlers:
            handler.setFormatter(formatter)
    return True


def connect_celery_signals(log_format: str) -> None:
    """Re-apply the JSON formatter after Celery configured its loggers in a worker."""
    if log_format != "json":
        return
    from celery import signals

    # The logger Celery set up (the root, or a named one) is one of those `install` formats.
    def reformat(**_: Any) -> None:
        install("json")

    signals.after_setup_logger.connect(reformat, weak=False, dispatch_uid="agentq.logs.json")
    signals.after_setup_task_logger.connect(
        reformat, weak=False, dispatch_uid="agentq.logs.json.task"
    )

    # A task's turn (and call), bound from its arguments for the whole of its run, so
    # Celery's own lines about it (`... succeeded in 0.002s`) carry them too.
    tokens: dict[str, Any] = {}

    def prerun(
        task_id: str | None = None,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        kw = kwargs or {}
        turn_id = kw.get("turn_id") or (args[0] if args and isinstance(args[0], str) else None)
        if task_id is not None and isinstance(turn_id, str):
            tokens[task_id] = bind(turn_id, kw.get("call_id"), task_id)

    def postrun(task_id: str | None = None, **_: Any) -> None:
        token = tokens.pop(task_id, None) if task_id is not None else None
        if token is not None:
            # A token from another thread (a duplicate delivery) cannot be reset here.
            with contextlib.suppress(ValueError):
                unbind(token)

    signals.task_prerun.connect(prerun, weak=False, dispatch_uid="agentq.logs.prerun")
    signals.task_postrun.connect(postrun, weak=False, dispatch_uid="agentq.logs.postrun")
