"""Tools for the chaos soak (`scripts/chaos.py`): every run leaves a line in a file.

A run appends ``turn_id/call_id`` to ``$AGENTQ_CHAOS_DIR/runs.log`` the moment it
starts (one short ``O_APPEND`` write, atomic between processes), so the soak proves
that no call of a non-idempotent tool ran twice, whatever was killed or failed over.
"""

from __future__ import annotations

import asyncio
import os
import time

from agentq.testing.tools import sleep_through
from agentq.tools.context import ToolContext
from agentq.tools.registry import tool

RUNS_FILE = "runs.log"


def _record(ctx: ToolContext, tag: str) -> None:
    path = os.path.join(os.environ.get("AGENTQ_CHAOS_DIR", "."), RUNS_FILE)
    line = f"{tag} {ctx.turn_id}/{ctx.call_id} {os.getpid()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@tool(timeout_s=20, budget_s=5)
def chaos_work(ctx: ToolContext, seconds: float = 0.5) -> dict[str, object]:
    """Non-idempotent sync work: records its run, then sleeps."""
    _record(ctx, "once")
    sleep_through(seconds)
    return {"slept_s": seconds}


@tool(timeout_s=20, budget_s=5, idempotent=True, max_retries=3)
def chaos_idempotent(ctx: ToolContext, seconds: float = 0.5) -> dict[str, object]:
    """Idempotent sync work: may run again after its process died."""
    _record(ctx, "again")
    sleep_through(seconds)
    return {"slept_s": seconds}


@tool(timeout_s=20, budget_s=5)
async def chaos_async(ctx: ToolContext, seconds: float = 0.5) -> dict[str, object]:
    """Non-idempotent async work on the I/O worker: records its run, then sleeps."""
    _record(ctx, "once")
    await asyncio.sleep(seconds)
    return {"slept_s": seconds}


@tool(timeout_s=1, budget_s=1)
def chaos_overrun(ctx: ToolContext, seconds: float = 3.0) -> str:
    """Blocks past its 1 s hard limit: settles `timeout`."""
    _record(ctx, "once")
    sleep_through(seconds)
    return "woke up"


@tool(timeout_s=10, approval="ask", approval_timeout_s=2)
def chaos_ask(ctx: ToolContext, note: str = "") -> str:
    """Asks for approval (2 s); silence denies."""
    _record(ctx, "once")
    return f"approved {note}"


@tool(timeout_s=60, budget_s=30)
def chaos_subagent(ctx: ToolContext, prompt: str, wait_s: float = 45.0) -> dict[str, object]:
    """Runs a sub-agent turn and returns how it ended."""
    from agentq.api import Client

    _record(ctx, "once")
    client = Client()
    handle = client._start_turn(prompt, parent_turn_id=ctx.turn_id, headless=True)
    deadline = time.monotonic() + wait_s
    for ev in client.events(handle.turn_id, heartbeat_s=1.0, depth=0):
        if ev is not None and ev.type in ("turn_finished", "turn_aborted", "turn_error"):
            return {"child": handle.turn_id, "ended": ev.type}
        if time.monotonic() > deadline or ctx.cancelled:
            break
    return {"child": handle.turn_id, "ended": "still running"}
