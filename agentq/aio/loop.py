"""One asyncio loop on a background thread, with backpressure and a blocked-loop watchdog.

Celery has no asyncio pool: its `threads` pool `submit`s each task's coroutine here,
blocking while the loop holds `capacity` of them, so the broker keeps what the process
cannot take. A watchdog thread reads when the loop last stopped waiting for I/O, names the
task holding it (`on_blocked`) and, past a hard deadline given to `watch`, calls `on_stuck`.
Nothing runs on the loop for it: a 50 Hz pulse coroutine cost 1% of a core per process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("agentq.aio")

T = TypeVar("T")

WATCH_S = 0.05
"""How often the watchdog thread looks while the loop holds a coroutine or a deadline."""
IDLE_WATCH_S = 0.5
"""How often it looks while the loop holds nothing (a submit wakes it at once)."""
STUCK_GRACE_S = 0.5
"""A stall this long past a call's hard deadline recycles the process."""
STOP_WAIT_S = 2.0
"""How long a stopped loop waits for what it cancelled before it closes."""


class _WatchedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """`busy_since`: when the loop last stopped waiting for I/O (None while it waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.busy_since: float | None = time.monotonic()

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        self.busy_since = None
        try:
            return super().select(timeout)  # type: ignore[no-any-return]
        finally:
            self.busy_since = time.monotonic()


class EventLoopThread:
    """The process's loop: `start()` once, `submit()` from any thread."""

    def __init__(
        self,
        *,
        name: str = "agentq-loop",
        capacity: int = 2000,
        lag_warn_s: float = 0.1,
        on_blocked: Callable[[asyncio.Task[Any] | None, float], None] | None = None,
        on_stuck: Callable[[asyncio.Task[Any] | None, str], None] | None = None,
    ) -> None:
        self.lag_warn_s = lag_warn_s
        self.on_blocked = on_blocked
        self.on_stuck = on_stuck
        self._selector = _WatchedSelector()
        self.loop = asyncio.SelectorEventLoop(self._selector)
        self._slots = threading.BoundedSemaphore(capacity)
        self.held = 0
        """Coroutines submitted and not finished."""
        self._lock = threading.Lock()
        """Guards `held` and `_deadlines`."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._nudge = threading.Event()  # wakes the idle watchdog: the first submit, or stop
        self._deadlines: dict[str, float] = {}

    def start(self) -> EventLoopThread:
        if not self._thread.is_alive():
            self._thread.start()
            self._started.wait(10)
            self._watchdog.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._nudge.set()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if self._watchdog.is_alive():
            self._watchdog.join(timeout_s)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            _close(self.loop)

    def submit(self, coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `coro_fn()` on the loop; blocks while the loop is at capacity."""
        self._slots.acquire()
        with self._lock:
            self.held += 1
            woke = self.held == 1
        if woke:
            self._nudge.set()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        except BaseException:
            self._release()
            raise
        fut.add_done_callback(lambda _: self._release())
        return fut

    def _release(self) -> None:
        with self._lock:
            self.held -= 1
        self._slots.release()

    def watch(self, key: str, hard_deadline_mono: float) -> None:
        """A hard deadline (time.monotonic()) the loop must reach unblocked."""
        with self._lock:
            self._deadlines[key] = hard_deadline_mono

    def unwatch(self, key: str) -> None:
        with self._lock:
            self._deadlines.pop(key, None)

    def _watch(self) -> None:
        reported_for: float | None = None
        while not self._stopping.is_set():
            self._nudge.wait(WATCH_S if self.held or self._deadlines else IDLE_WATCH_S)
            self._nudge.clear()
            since = self._selector.busy_since
            if since is None:
                continue
            now = time.monotonic()
            stalled_s = now - since
            if stalled_s < self.lag_warn_s:
                continue
            task = asyncio.current_task(self.loop)  # read from another thread: racy, enough
            if reported_for != since and self.on_blocked is not None:
                reported_for = since
                try:
                    self.on_blocked(task, stalled_s)
                except Exception:
                    log.exception("on_blocked failed")
            with self._lock:
                due = [k for k, d in self._deadlines.items() if now > d + STUCK_GRACE_S]
            if due and self.on_stuck is not None:
                why = (
                    f"the event loop has been blocked for {stalled_s:.1f} s, past the hard "
                    f"limit of {len(due)} call(s) on it"
                )
                self.on_stuck(task, why)
                return


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left and close, as asyncio.run does: on CPython 3.11 a pending task's
    finalizer that runs inside ast.parse corrupts the parser's recursion count (SystemError:
    AST constructor recursion depth mismatch) in whatever parses next."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        # Bounded: on 3.11 asyncio.wait_for can swallow a cancel that meets its result.
        loop.run_until_complete(asyncio.wait(pending, timeout=STOP_WAIT_S))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
