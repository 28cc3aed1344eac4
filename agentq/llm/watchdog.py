"""The inactivity watchdog of one streaming attempt (design.md, "Time limits").

A model server can answer 200 and then send nothing, keeping the socket open; no
transport timeout fires while it does, or keep-alive comments reset it. The
watchdog measures the silence since the last parsed chunk (reasoning-only chunks
count, SSE comments do not) from a helper thread that also polls the abort flag.
When either fires it cuts the connection, which unblocks the reading thread; that
thread then raises `error()`: `Aborted` when the user aborted, even if the silence
limit fired at the same moment, else `StreamIdleTimeout` (code ETIMEDOUT).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from agentq.errors import Aborted, AgentqError, StreamIdleTimeout
from agentq.fleet.lifecycle import Started

log = logging.getLogger(__name__)

TripReason = Literal["abort", "idle"]
POLL_S = 0.05


class StreamWatchdog(Started):
    """Watches one attempt: `start()` when the request goes out, `chunk()` per parsed chunk.

    `idle_timeout_ms <= 0` disables the silence limit; abort polling still runs.
    `interrupt` is called once, from the helper thread, when the watchdog trips.
    """

    def __init__(
        self,
        *,
        idle_timeout_ms: int,
        cancelled: Callable[[], bool],
        interrupt: Callable[[], object],
        turn_id: str = "",
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_timeout_ms = idle_timeout_ms
        self._idle_s = idle_timeout_ms / 1000.0 if idle_timeout_ms > 0 else None
        self._cancelled = cancelled
        self._interrupt = interrupt
        self._turn_id = turn_id
        self._poll_s = poll_s
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started_at = clock()
        self._last_activity = self._started_at
        self._chunks = 0
        self._tripped: TripReason | None = None
        self._lifetime_ms = 0

    @property
    def chunks_received(self) -> int:
        return self._chunks

    @property
    def tripped(self) -> TripReason | None:
        with self._lock:
            return self._tripped

    def start(self) -> StreamWatchdog:
        if self._thread is not None:
            return self
        self._started_at = self._last_activity = self._clock()
        self._thread = threading.Thread(target=self._run, name="agentq-llm-watchdog", daemon=True)
        self._thread.start()
        return self

    def chunk(self) -> None:
        """A parsed chunk arrived: count it and restart the silence clock."""
        self._chunks += 1
        self._last_activity = self._clock()

    def touch(self) -> None:
        """Restart the silence clock, so time spent handling a chunk is not silence."""
        self._last_activity = self._clock()

    def stop(self) -> None:
        """Stop watching and join the helper thread; `tripped` is final afterwards."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def error(self) -> AgentqError | None:
        """The error the reading thread raises after a trip, or None."""
        with self._lock:
            reason, lifetime_ms = self._tripped, self._lifetime_ms
        if reason is None:
            return None
        if reason == "abort" or self._is_cancelled():
            return Aborted(self._turn_id)
        return StreamIdleTimeout(self.idle_timeout_ms, self._chunks, lifetime_ms)

    def raise_if_tripped(self) -> None:
        err = self.error()
        if err is not None:
            raise err

    def _is_cancelled(self) -> bool:
        try:
            return bool(self._cancelled())
        except Exception:
            # A broken abort probe must not kill the silence limit with it.
            log.warning("cancelled() raised; treating the turn as not aborted", exc_info=True)
            return False

    def _run(self) -> None:
        while True:
            wait_s = self._poll_s
            if self._idle_s is not None:
                until_idle_s = self._last_activity + self._idle_s - self._clock()
                wait_s = max(min(wait_s, until_idle_s), 0.0)
            if self._stop.wait(wait_s):
                return
            if self._is_cancelled():
                self._trip("abort")
                return
            silent_s = self._clock() - self._last_activity
            if self._idle_s is not None and silent_s >= self._idle_s:
                # Abort wins: read the flag again at the moment the limit fires.
                self._trip("abort" if self._is_cancelled() else "idle")
                return

    def _trip(self, reason: TripReason) -> None:
        with self._lock:
            self._tripped = reason
            self._lifetime_ms = int((self._clock() - self._started_at) * 1000)
        try:
            self._interrupt()
        except Exception:
            log.warning("could not interrupt the model stream", exc_info=True)
