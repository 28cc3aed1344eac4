"""Async tools for demos and tests, run by `agentq worker io` (loaded with agentq.testing.tools)."""

from __future__ import annotations

import asyncio
import os
import time

from agentq.tools.context import Partial, ToolContext
from agentq.tools.registry import tool


@tool(timeout_s=30, budget_s=10)
async def aio_sleep(ctx: ToolContext, seconds: float) -> dict[str, object]:
    """Wait without blocking (an async HTTP call, say), reporting progress."""
    start = time.time()
    ctx.progress("waiting", pct=0)
    await asyncio.sleep(seconds)
    return {"slept_s": round(time.time() - start, 3), "pid": os.getpid()}


@tool(timeout_s=10)
async def aio_two_steps(ctx: ToolContext, seconds: float = 0.8) -> str:
    """Report progress at once and again after `seconds`."""
    ctx.progress("first step", pct=0)
    await asyncio.sleep(seconds)
    ctx.progress("second step", pct=50)
    await asyncio.sleep(0.05)
    return "done"


@tool(timeout_s=10, budget_s=1)
async def aio_echo(text: str) -> str:
    """Echo the text back, asynchronously."""
    await asyncio.sleep(0)
    return text


@tool(timeout_s=1, budget_s=1)
async def aio_stuck(seconds: float = 60) -> str:
    """Wait past its 1 s hard limit, deaf to the soft limit."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            await asyncio.sleep(end - time.monotonic())
        except asyncio.CancelledError as exc:
            if "soft" not in str(exc.args[0] if exc.args else ""):
                raise
    return "woke up"


@tool(timeout_s=2, soft_timeout_s=0.5, budget_s=1)
async def aio_gather(ctx: ToolContext, items: int = 100) -> object:
    """Collect items slowly; at the soft limit, return what it has."""
    got: list[int] = []
    try:
        for i in range(items):
            await asyncio.sleep(0.05)
            got.append(i)
    except asyncio.CancelledError:
        return Partial({"items": got, "complete": False, "soft": ctx.soft_limited})
    return {"items": got, "complete": True}


@tool(timeout_s=2, soft_timeout_s=0.5, budget_s=1)
async def aio_ignore_soft(ctx: ToolContext, seconds: float = 1.0) -> dict[str, object]:
    """Do not catch the soft limit: settles timeout (soft)."""
    await asyncio.sleep(seconds)
    return {"done": True}


@tool(timeout_s=10)
async def aio_fail(message: str = "boom") -> str:
    """Always raise."""
    await asyncio.sleep(0)
    raise RuntimeError(message)


@tool(timeout_s=30)
async def aio_cancellable(ctx: ToolContext, seconds: float = 30) -> dict[str, object]:
    """Wait long; an abort cancels it and it records that it saw the cancellation."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        # Seen by the test through the tool's last progress event.
        ctx.progress("cancelled", cancelled=ctx.cancelled)
        raise
    return {"done": True}


@tool(timeout_s=5, budget_s=1)
async def aio_block(seconds: float = 0.5) -> str:
    """Misbehave: a blocking sleep inside async def stalls the whole loop."""
    time.sleep(seconds)
    return f"blocked {seconds}s"


@tool(timeout_s=1, budget_s=1, queue="agentq.io.recycle")
async def aio_block_forever(seconds: float = 30) -> str:
    """Block the loop past its 1 s hard limit: the worker must recycle itself."""
    time.sleep(seconds)
    return "unreachable"


@tool(timeout_s=1, thread=True)
def thread_sleep(ctx: ToolContext, seconds: float = 0.2) -> dict[str, object]:
    """A sync tool on a thread of the I/O worker; past 1 s its thread is abandoned."""
    time.sleep(seconds)
    return {"slept_s": seconds, "soft": ctx.soft_limited}


@tool(timeout_s=10)
def returns_coroutine() -> object:
    """Misuse: a sync def that returns a coroutine (a forgotten `async`)."""
    return asyncio.sleep(0)
