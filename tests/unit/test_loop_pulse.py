"""The event loop's watchdog: it reads the loop's selector, so nothing runs on the loop for
it; a stall is reported once, at its own length, even right after an idle spell."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agentq.aio.loop import IDLE_WATCH_S, EventLoopThread


def wait_until(pred: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_loop_that_waits_for_io_is_not_busy_and_runs_nothing_of_the_watchdogs() -> None:
    seen: list[float] = []
    loop = EventLoopThread(
        name="t-idle", lag_warn_s=0.05, on_blocked=lambda task, stalled_s: seen.append(stalled_s)
    ).start()
    try:
        wait_until(lambda: loop._selector.busy_since is None)
        assert asyncio.run_coroutine_threadsafe(_tasks(), loop.loop).result(5) == 0

        async def hold() -> None:
            for _ in range(30):  # a held loop, many short iterations: never a stall
                await asyncio.sleep(0.01)

        loop.submit(hold).result(5)
        assert seen == []
    finally:
        loop.stop()


async def _tasks() -> int:
    """Tasks on the loop besides the caller's."""
    return len(asyncio.all_tasks()) - 1


def test_a_stall_right_after_an_idle_spell_is_reported_once_at_its_own_length() -> None:
    seen: list[float] = []
    loop = EventLoopThread(
        name="t-stall", lag_warn_s=0.1, on_blocked=lambda task, stalled_s: seen.append(stalled_s)
    ).start()
    try:
        time.sleep(IDLE_WATCH_S * 0.8)  # the watchdog deep in an idle wait

        async def block() -> None:
            time.sleep(0.4)

        loop.submit(block).result(5)
        wait_until(lambda: bool(seen))
        # Counted from when the loop took the coroutine up, seen within a watch period (and
        # read, at most, just after the blocking call returned, before the loop waits again).
        assert 0.1 <= seen[0] <= 0.4 + 0.15, seen
        loop.submit(lambda: asyncio.sleep(0.3)).result(5)  # the loop waits: no stall
        assert len(seen) == 1, seen
    finally:
        loop.stop()


def test_stop_cancels_what_the_loop_holds_and_closes_it() -> None:
    loop = EventLoopThread(name="t-stop").start()
    running = threading.Event()
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            running.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loop.submit(forever)
    assert running.wait(5)
    loop.stop()
    # Nothing is left for the garbage collector to finalize (see aio.loop._close).
    assert cancelled.is_set()
    assert loop.loop.is_closed()
