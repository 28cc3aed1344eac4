"""Abort, in-process: the loop hears CANCEL_CHANNEL and cancels within milliseconds.

A slow poll of the cancel keys of the turns the loop holds catches a message missed while
the subscription was reconnecting. The same subscription hears WATCH_CHANNEL (a turn's
first follower, for whoever holds back its events) and SLOTS_CHANNEL (a semaphore's place
given back wakes the calls waiting for one).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from agentq import constants as k
from agentq.fleet.connections import (
    async_cluster_client,
    async_node_client,
    async_redis_client,
)
from agentq.state.base import text

log = logging.getLogger("agentq.aio")

POLL_S = 1.0
RECENT_TURNS = 10_000
"""Aborts that found no callback, remembered for one registered just after (a round is
claimed off the loop and registers when the loop takes it up): the newest this many."""


class CancelWatch:
    """Turn id -> callbacks run (on the loop) once that turn is aborted."""

    current: CancelWatch | None = None
    """The watch started on this process's loop (its `LoopHost`'s)."""

    def __init__(
        self,
        redis_url: str,
        master_name: str | None = None,
        *,
        cluster_nodes: str | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self._url = redis_url
        self._master = master_name
        self._cluster = cluster_nodes
        self._poll_s = poll_s
        self._handlers: dict[str, list[Callable[[], None]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._recent: dict[str, None] = {}
        """Aborted turns that had no callback yet, oldest first."""
        self.on_watch: Callable[[str], None] | None = None
        self._freed: dict[str, set[asyncio.Future[None]]] = {}

    def start(self) -> None:
        CancelWatch.current = self
        self._tasks = [
            asyncio.get_running_loop().create_task(self._listen(), name="agentq-cancel-listen"),
            asyncio.get_running_loop().create_task(self._poll(), name="agentq-cancel-poll"),
        ]

    def add(self, turn_id: str, fn: Callable[[], None]) -> Callable[[], None]:
        """On the loop: run `fn` when `turn_id` is aborted; returns the remover."""
        handlers = self._handlers.setdefault(turn_id, [])
        handlers.append(fn)
        if turn_id in self._recent:
            asyncio.get_running_loop().call_soon(self.fire, turn_id)

        def remove() -> None:
            if self._handlers.get(turn_id) is handlers:  # not fired yet
                handlers.remove(fn)
                if not handlers:
                    del self._handlers[turn_id]

        return remove

    def fire(self, turn_id: str) -> int:
        """Run (once) every callback of `turn_id`; returns how many ran."""
        handlers = self._handlers.pop(turn_id, [])
        if not handlers:
            self._recent.pop(turn_id, None)
            self._recent[turn_id] = None
            if len(self._recent) > RECENT_TURNS:
                del self._recent[next(iter(self._recent))]
        for fn in handlers:
            try:
                fn()
            except Exception:
                log.exception("cancel callback of turn %s failed", turn_id)
        return len(handlers)

    def on_freed(self, key: str) -> asyncio.Future[None]:
        """On the loop: a future done when the semaphore `key` gives a place back; taken before
        the caller's try, so a place freed during the try still wakes it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._freed.setdefault(key, set())
        waiters.add(fut)
        fut.add_done_callback(waiters.discard)
        return fut

    async def _listen(self) -> None:
        delay_s = 0.1
        for attempt in itertools.count():
            if self._cluster:
                client = async_node_client(self._cluster, attempt)
            else:
                client = async_redis_client(self._url, self._master)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(k.CANCEL_CHANNEL, k.WATCH_CHANNEL, k.SLOTS_CHANNEL)
                delay_s = 0.1
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    channel, said = text(msg["channel"]), text(msg["data"])
                    if channel == k.CANCEL_CHANNEL:
                        self.fire(said)
                    elif channel == k.SLOTS_CHANNEL:
                        for fut in self._freed.pop(said, set()):
                            if not fut.done():
                                fut.set_result(None)
                    elif self.on_watch is not None:
                        self.on_watch(said)
            except Exception as exc:  # not a cancel: a BaseException
                log.warning("cancel channel lost (%s); resubscribing in %.1f s", exc, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                await client.aclose()

    async def _poll(self) -> None:
        client: Any = (
            async_cluster_client(self._cluster)
            if self._cluster
            else async_redis_client(self._url, self._master)
        )
        try:
            while True:
                await asyncio.sleep(self._poll_s)
                turns = list(self._handlers)
                if not turns:
                    continue
                try:
                    # One MGET, not an EXISTS per turn: a loop holding a thousand turns
                    # spent 4% of its time packing and parsing those each second.
                    keys = [k.turn_key(t, "cancel") for t in turns]
                    flags = await (
                        client.mget_nonatomic(keys) if self._cluster else client.mget(keys)
                    )
                except Exception as exc:
                    log.warning("cannot poll cancel keys: %s", exc)
                    continue
                for t, flag in zip(turns, flags, strict=True):
                    if flag is not None:
                        self.fire(t)
        finally:
            await client.aclose()
