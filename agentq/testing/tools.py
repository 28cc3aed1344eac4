"""Tools for demos and tests: load with AGENTQ_TOOLS=agentq.testing.tools."""

from __future__ import annotations

import os
import signal
import time

from celery.exceptions import SoftTimeLimitExceeded

from agentq.tools.context import Partial, ToolContext
from agentq.tools.registry import tool


@tool(timeout_s=10, budget_s=1)
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool(timeout_s=30, budget_s=5)
def sleep(ctx: ToolContext, seconds: float) -> dict[str, object]:
    """Sleep for a number of seconds, reporting progress, then say how long it slept."""
    start = time.time()
    while time.time() - start < seconds:
        if ctx.cancelled:
            return {"slept_s": round(time.time() - start, 3), "cancelled": True}
        ctx.progress("sleeping", pct=round(100 * (time.time() - start) / max(seconds, 1e-9), 1))
        time.sleep(min(0.5, max(0.0, seconds - (time.time() - start))))
    return {"slept_s": round(time.time() - start, 3), "pid": os.getpid()}


def sleep_through(seconds: float) -> None:
    """Sleep like an uninterruptible call: deaf to cancellation and the soft limit."""
    end = time.time() + seconds
    while time.time() < end:
        try:
            time.sleep(max(0.0, end - time.time()))
        except SoftTimeLimitExceeded:
            continue


@tool(timeout_s=2, budget_s=1)
def stuck(seconds: float = 60) -> str:
    """Block past its 2 s hard limit."""
    sleep_through(seconds)
    return "woke up"


# The hard limit comes before the 60 s sleep ends: a call that ended at the very moment of
# its kill once left the session's tool worker taking no more tasks. (Not in the docstring:
# that is the description every test turn offers the model, and budget tests count it.)
@tool(timeout_s=50, budget_s=1)
def hang(seconds: float = 60) -> dict[str, object]:
    """Block for a long time in one call; only killing the process stops it."""
    sleep_through(seconds)
    return {"woke": True, "pid": os.getpid()}


@tool(timeout_s=2, soft_timeout_s=1, budget_s=1)
def gather(items: int = 100) -> object:
    """Collect items slowly; on the soft limit, return what was collected so far."""
    got: list[int] = []
    try:
        for i in range(items):
            time.sleep(0.05)
            got.append(i)
    except SoftTimeLimitExceeded:
        return Partial({"items": got, "complete": False}, note="soft limit")
    return {"items": got, "complete": True}


@tool(timeout_s=10, budget_s=0.2)
def slowpoke(seconds: float = 0.5) -> str:
    """Finish after its advisory budget."""
    time.sleep(seconds)
    return f"done after {seconds}s"


@tool(timeout_s=10, concurrency="exclusive")
def exclusive_write(ctx: ToolContext, seconds: float = 0.3) -> dict[str, float]:
    """Exclusive: must never overlap another call of its round."""
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time()}


@tool(timeout_s=10)
def stamp(seconds: float = 0.3) -> dict[str, float]:
    """Record when it ran."""
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time()}


@tool(timeout_s=10)
def fail(message: str = "boom") -> str:
    """Always raise."""
    raise RuntimeError(message)


@tool(timeout_s=10)
def big(size_bytes: int = 200_000) -> str:
    """Return a large result."""
    return "x" * size_bytes


@tool(timeout_s=30)
def die(seconds: float = 0.2) -> str:
    """Kill its own worker process mid-call (a crash)."""
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@tool(timeout_s=30, idempotent=True, max_retries=2)
def die_once(marker: str) -> str:
    """Crash on the first attempt (marker file absent), succeed on the retry."""
    if not os.path.exists(marker):
        with open(marker, "w") as fh:
            fh.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


@tool(timeout_s=10, approval="ask", approval_timeout_s=120)
def delete_file(path: str) -> str:
    """A destructive tool that asks for approval first."""
    return f"deleted {path}"


@tool(timeout_s=10, approval="ask", approval_default="deny")
def rm_rf(path: str) -> str:
    """Asks; headless turns deny it by its declared default."""
    return f"removed {path}"


@tool(timeout_s=10, approval="ask", approval_kind="password")
def login(ctx: ToolContext, user: str) -> str:
    """Needs a password, asked from the user and handed over by reference."""
    secret = ctx.secret()
    return f"logged in {user}" if secret else f"no password for {user}"


@tool(timeout_s=10, approval="deny")
def forbidden() -> str:
    """Denied by policy."""
    return "should never run"


@tool(timeout_s=10, budget_s=1)
def noop() -> None:
    """Do nothing: scripts/bench.py measures agentq's own cost per call with it."""
    return None


@tool(timeout_s=1, budget_s=1)
def bench_sleep(seconds: float = 5) -> str:
    """Block past its 1 s hard limit, deaf to the soft limit: the bench's timeout probe."""
    sleep_through(seconds)
    return "woke up"


@tool(timeout_s=10, approval="ask", approval_timeout_s=1.0)
def ask_quick(path: str) -> str:
    """Asks for approval with a 1 s timeout (tests of the deny-on-silence rule)."""
    return f"touched {path}"


@tool(timeout_s=0, budget_s=600, queue="agentq.held")
def held(ctx: ToolContext, seconds: float = 600) -> str:
    """Wait a long time on its own queue (the benchmark's held stage), until cancelled."""
    end = time.time() + seconds
    while time.time() < end and not ctx.cancelled:
        time.sleep(0.2)
    return "released"


# The async tools register with these: one AGENTQ_TOOLS module serves both tool workers.
import agentq.testing.aio_tools as _aio_tools  # noqa: E402, F401
