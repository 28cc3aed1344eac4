"""What an event-loop worker process holds: its loop, the cancel channel, a thread pool for
the store's blocking Redis calls, and the calls on the loop, for blame when it blocks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from agentq import constants as k
from agentq.aio.cancel import CancelWatch
from agentq.aio.loop import EventLoopThread
from agentq.config import get_settings
from agentq.fleet.runtime import get_store

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.aio")

T = TypeVar("T")

STORE_THREADS = 4
"""Threads for the loop's store calls (short round trips). Each may hold a Redis connection:
16 gave a stream worker 44 connections and no faster io stage than 8 or 4."""


@dataclass
class Running:
    """One unit of work on the loop, for blame and for settling when the process recycles."""

    turn_id: str
    what: str
    """e.g. "call c_1 of tool fetch" or "model round 2"."""
    on_recycle: Callable[[str, bool], None] | None = None
    """Settle it synchronously (from the watchdog thread): (why, it_blocked_the_loop)."""
    ids: dict[str, str] = field(default_factory=dict)


class LoopHost:
    def __init__(self) -> None:
        self.settings = settings = get_settings()
        self.store: TurnStore = get_store()
        self.pool = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="agentq-store")
        self.threads = ThreadPoolExecutor(256, thread_name_prefix="agentq-tool-thread")
        self.running: dict[str, Running] = {}
        self.hostname = ""
        self.loop = EventLoopThread(
            capacity=settings.io_capacity,
            lag_warn_s=settings.loop_lag_warn_ms / 1000,
            on_blocked=self._on_blocked,
            on_stuck=self._on_stuck,
        )
        self.cancels = CancelWatch(
            settings.redis_url,
            settings.redis_sentinel_master,
            cluster_nodes=settings.redis_cluster_nodes,
        )
        self.loop.start()
        self.loop.loop.call_soon_threadsafe(self.cancels.start)

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking store call off the loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args, **kwargs)
        )

    def _blamed(self, task: asyncio.Task[Any] | None) -> tuple[str, Running | None]:
        name = task.get_name() if task is not None else ""
        return name, self.running.get(name)

    def _on_blocked(self, task: asyncio.Task[Any] | None, stalled_s: float) -> None:
        name, run = self._blamed(task)
        culprit = run.what if run else (name or "unknown code")
        log.warning(
            "event loop blocked for %.0f ms by %s: a blocking call inside async def stalls "
            "every other call on this worker; await an async API or declare the tool "
            "thread=True (sync)",
            stalled_s * 1000,
            culprit,
        )
        if run is not None:
            where = self.hostname or "its worker"
            with contextlib.suppress(Exception):
                self.store.bus.publish(
                    run.turn_id,
                    "tool_progress",
                    state="blocking",
                    source="worker",
                    message=f"{culprit} is blocking the event loop of {where}",
                    blocked_ms=int(stalled_s * 1000),
                    **run.ids,
                )

    def _on_stuck(self, task: asyncio.Task[Any] | None, why: str) -> None:
        name, culprit = self._blamed(task)
        log.critical(
            "%s (%s): recycling this worker process", why, culprit.what if culprit else name
        )
        for key, run in list(self.running.items()):
            if run.on_recycle is None:
                continue
            blocked = key == name
            reason = (
                f"{run.what} blocked the event loop past its hard limit; the worker was recycled"
                if blocked
                else f"its I/O worker was recycled: {culprit.what if culprit else 'a call'} "
                "blocked the event loop"
            )
            with contextlib.suppress(Exception):
                run.on_recycle(reason, blocked)
        if self.hostname:
            # The turn need not wait for the heartbeat to lapse.
            with contextlib.suppress(Exception):
                self.store.redis.delete(k.worker_alive_key(self.hostname))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(k.RECYCLE_EXIT_CODE)


_lock = threading.Lock()
_host: LoopHost | None = None


def get_host() -> LoopHost:
    """This process's loop host, started on first use."""
    global _host
    with _lock:
        if _host is None:
            _host = LoopHost()
        return _host
