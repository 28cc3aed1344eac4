"""Tools that end their run with a Waitpoint (tests/integration/test_waitpoints.py, the
waitpoint faults, webhooks and browser tests, the bench's waitpoints stage), and tools
that raise once they see their turn's abort (tests/integration/test_io_worker.py).

Kept apart from agentq.testing.tools: fleets whose budgets are sized by the prompt a round
sends (every tool offered counts) load those alone.
"""

from __future__ import annotations

import asyncio
import os
import time

from agentq.tools.context import ToolContext, Waitpoint
from agentq.tools.registry import tool


@tool(timeout_s=10)
def await_callback(ctx: ToolContext, timeout_s: float = 30, note: str = "") -> Waitpoint:
    """End the run with a waitpoint (as a tool that started a CI job would), telling the
    outside world its id through `data`."""
    wp = ctx.waitpoint()
    return Waitpoint(
        timeout_s=timeout_s,
        data={"note": note, "waitpoint_id": wp.id, "pid": os.getpid()},
        idempotency_key=f"job-{ctx.call_id}",
        tags=("test",),
    )


@tool(timeout_s=10)
async def aio_await_callback(ctx: ToolContext, timeout_s: float = 30) -> Waitpoint:
    """`await_callback` on the I/O worker: the slot is free once it returns."""
    await asyncio.sleep(0)
    return Waitpoint(timeout_s=timeout_s, data={"waitpoint_id": ctx.waitpoint().id})


@tool(timeout_s=20)
def raise_on_abort(ctx: ToolContext) -> str:
    """Wait for the turn's abort, then raise."""
    while not ctx.cancelled:
        time.sleep(0.02)
    raise RuntimeError("saw the abort")


@tool(timeout_s=20)
async def aio_raise_on_abort(ctx: ToolContext) -> str:
    """`raise_on_abort` on the I/O worker."""
    while not ctx.cancelled:
        await asyncio.sleep(0.02)
    raise RuntimeError("saw the abort")
