"""What a log line or span is about: the turn, call and Celery task the code runs for.

Set by the step, the tool task and the model round (only while JSON logs or tracing are
on, so the hot path pays nothing otherwise); read by the JSON log formatter.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import NamedTuple


class LogContext(NamedTuple):
    turn_id: str | None = None
    call_id: str | None = None
    task_id: str | None = None


_EMPTY = LogContext()
_current: ContextVar[LogContext] = ContextVar("agentq_log_context", default=_EMPTY)


def bind(
    turn_id: str | None, call_id: str | None = None, task_id: str | None = None
) -> Token[LogContext]:
    """Make the ids current (in this thread, or this asyncio task); undo with `unbind`."""
    return _current.set(LogContext(turn_id, call_id, task_id))


def unbind(token: Token[LogContext]) -> None:
    _current.reset(token)


def current() -> LogContext:
    return _current.get()


__all__ = ["LogContext", "bind", "current", "unbind"]
