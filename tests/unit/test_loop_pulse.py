"""The event loop's pulse: slow while the loop holds nothing, and a stall of a coroutine
submitted to an idle loop still seen and measured from its submit."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agentq.aio.loop import IDLE_PULSE_S, PULSE_S, EventLoopThread


def wait_until(pred: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_idle_loop_pulses_slowly_and_a_submit_makes_it_pulse_fast() -> None:
    loop = EventLoopThread(name="t-idle").start()
    try:
        wait_until(lambda: loop._period_s == IDLE_PULSE_S)
        release = threading.Event()

        async def hold() -> None:
            while not release.is_set():
                await asyncio.sleep(0.01)

        fut = loop.submit(hold)
        assert loop._period_s == PULSE_S
        beats = []
        for _ in range(3):
            before = loop.beat
            wait_until(lambda b=before: loop.beat != b, timeout_s=IDLE_PULSE_S / 2)  # type: ignore[misc]
            beats.append(loop.beat)
        release.set()
        fut.result(5)
        wait_until(lambda: loop._period_s == IDLE_PULSE_S)
        assert loop.max_lag_ms < 100, loop.max_lag_ms
    finally:
        loop.stop()


def test_a_stall_right_after_an_idle_spell_is_reported_at_its_own_length() -> None:
    seen: list[float] = []
    loop = EventLoopThread(
        name="t-stall", lag_warn_s=0.1, on_blocked=lambda task, stalled_s: seen.append(stalled_s)
    ).start()
    try:
        wait_until(lambda: loop._period_s == IDLE_PULSE_S)
        time.sleep(IDLE_PULSE_S * 0.8)  # deep in an idle sleep

        async def block() -> None:
            time.sleep(0.4)

        loop.submit(block).result(5)
        wait_until(lambda: bool(seen))
        # Counted from the submit, not from the last idle beat (up to IDLE_PULSE_S earlier).
        assert 0.1 <= seen[0] <= 0.4 + 0.15, seen
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
