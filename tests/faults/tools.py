"""Tools for the fault suite; workers load them with AGENTQ_TOOLS=...,tests.faults.tools.

Each counting tool appends a line to a file the moment it starts, before any other
work: the file outlives worker kills and Redis restarts, so a test can prove that a
call ran exactly as often as it should.
"""

from __future__ import annotations

import asyncio
import os

from agentq.testing.tools import sleep_through
from agentq.tools.registry import tool


def _count(path: str) -> None:
    with open(path, "a") as fh:
        fh.write(f"{os.getpid()}\n")


@tool(timeout_s=30, budget_s=5)
def counted(path: str, seconds: float = 0.0) -> dict[str, object]:
    """Count a start in `path`, then sleep."""
    _count(path)
    sleep_through(seconds)
    return {"slept_s": seconds, "pid": os.getpid()}


@tool(timeout_s=30, budget_s=5, idempotent=True, max_retries=2)
def counted_idempotent(path: str, seconds: float = 0.0) -> dict[str, object]:
    """Like `counted`, but safe to run again: retried when its process dies."""
    _count(path)
    sleep_through(seconds)
    return {"slept_s": seconds, "pid": os.getpid()}


@tool(timeout_s=2, budget_s=1)
def counted_short(path: str, seconds: float = 30.0) -> str:
    """Count a start, then block past a 2 s hard limit."""
    _count(path)
    sleep_through(seconds)
    return "woke up"


@tool(timeout_s=10, approval="ask", approval_timeout_s=0.5)
def ask_quick(note: str = "") -> str:
    """Asks for approval with a half-second timeout: silence denies."""
    return f"approved {note}"


@tool(timeout_s=0, budget_s=5)
def counted_unlimited(path: str, seconds: float = 60.0) -> str:
    """Count a start, then run long with no hard limit at all (long-running by design)."""
    _count(path)
    sleep_through(seconds)
    return "done"


def _done(path: str) -> None:
    with open(path + ".done", "a") as fh:
        fh.write(f"{os.getpid()}\n")


@tool(timeout_s=30, budget_s=5)
def counted_through(path: str, seconds: float = 0.0) -> dict[str, object]:
    """Count a start in `path`, sleep, then count the end in `path`.done."""
    _count(path)
    sleep_through(seconds)
    _done(path)
    return {"slept_s": seconds, "pid": os.getpid()}


@tool(timeout_s=30, budget_s=5)
async def counted_async(path: str, seconds: float = 0.0) -> dict[str, object]:
    """Like `counted_through`, waiting on the I/O worker's loop."""
    _count(path)
    await asyncio.sleep(seconds)
    _done(path)
    return {"slept_s": seconds, "pid": os.getpid()}


@tool(timeout_s=60, budget_s=5)
def stubborn(path: str, seconds: float = 50.0) -> str:
    """Ignore SIGTERM, count a start in `path`, then block: only SIGKILL stops it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _count(path)
    sleep_through(seconds)
    return "outlived"
