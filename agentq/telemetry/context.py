"""What a log line or span is about: the turn, call and Celery task the code runs for.

Set by the step, the tool task and the model round (only while JSON logs or tracing are
on, so the hot path pays nothing otherwise); read by the JSON log formatter.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar, Token
from typing import NamedTuple


class LogContext(NamedTuple):
    turn_id: str | None = None
    call_id: str | None = None
    task_id: str | None = None


_EMPTY = LogContext()
_current: ContextVar[LogContext] = ContextVar("agentq_log_context", default=_EMPTY)


def celery_task() -> tuple[str | None, str | None]:
    """The id and name of the Celery task this thread runs, found as Celery's TaskFormatter
    finds them (without importing Celery into a process that has none)."""
    state = sys.modules.get("celery._state")
    if state is None:
        return None, None
    task = state.get_current_task()
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


def current() -> LogContext:
    return _current.get()
