"""JSON logs (`AGENTQ_LOG_FORMAT=json`): one JSON object a line, with the turn, call and
Celery task a line is about.

Workers switch it on from Celery's logging signals (so `celery -A agentq.worker worker`
gets it too), the gateway from its app factory. Each line carries `ts`, `level`,
`logger`, `message`, `pid`, and, where known, `turn_id`, `call_id`, `task_id` and
`task_name`; a traceback goes in `exc`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from agentq.telemetry.context import current

enabled = False
"""True once JSON logs are on in this process: the step, call and round bind their ids."""


def _celery_task() -> tuple[str | None, str | None]:
    """The id and name of the Celery task this thread runs, as Celery's TaskFormatter finds them."""
    mod = sys.modules.get("celery._state")
    if mod is None:
        return None, None
    task = mod.get_current_task()
    if task is None or task.request is None:
        return None, None
    return getattr(task.request, "id", None), getattr(task, "name", None)


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
        ctx = current()
        task_id, task_name = _celery_task()
        if ctx.turn_id is not None:
            out["turn_id"] = ctx.turn_id
        if ctx.call_id is not None:
            out["call_id"] = ctx.call_id
        # The bound id wins: on an event loop the Celery task that handed a call over is gone.
        task_id = ctx.task_id or task_id
        if task_id is not None:
            out["task_id"] = task_id
        if task_name is not None:
            out["task_name"] = task_name
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def _loggers() -> list[logging.Logger]:
    found = [logging.getLogger()]
    for obj in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(obj, logging.Logger):
            found.append(obj)
    return found


def apply(loggers: list[logging.Logger] | None = None) -> None:
    """Give every handler of these loggers (default: all loggers) the JSON formatter."""
    formatter = JsonFormatter()
    for logger in _loggers() if loggers is None else loggers:
        for handler in logger.handlers:
            handler.setFormatter(formatter)


def install(log_format: str) -> bool:
    """Switch this process to JSON logs if `log_format` is "json"; True if it did."""
    global enabled
    if log_format != "json":
        return False
    enabled = True
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    apply()
    return True


def connect_celery_signals(log_format: str) -> None:
    """Re-apply the JSON formatter after Celery configured its loggers in a worker."""
    if log_format != "json":
        return
    from celery.signals import after_setup_logger, after_setup_task_logger

    def reformat(logger: logging.Logger | None = None, **_: Any) -> None:
        install("json")
        if logger is not None:
            apply([logger])

    after_setup_logger.connect(reformat, weak=False, dispatch_uid="agentq.logs.json")
    after_setup_task_logger.connect(reformat, weak=False, dispatch_uid="agentq.logs.json.task")


__all__ = ["JsonFormatter", "apply", "connect_celery_signals", "enabled", "install"]
