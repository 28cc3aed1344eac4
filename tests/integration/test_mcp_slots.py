"""An MCP server's fleet-wide slots (`concurrency: N`): a call waiting for one is woken by a
slot given back or by the soonest lease's end, not by a poll; on a loop of this process
with its own control subscription, against a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from agentq import constants as k
from agentq.aio import cancel
from agentq.limits.semaphore import LeasedSemaphore
from agentq.mcp.servers import McpServer
from agentq.mcp.tools import _slot
from agentq.tools.context import ToolContext

pytestmark = pytest.mark.integration


def _ctx(said: list[str]) -> ToolContext:
    return ToolContext(
        turn_id="t" * 32,
        call_id=f"c_{uuid.uuid4().hex[:6]}",
        tool="s__t",
        started_at=time.time(),
        timeout_s=30.0,
        soft_timeout_s=None,
        on_progress=lambda message, _pct, _meta: said.append(message),
    )


async def _enter(server: McpServer, said: list[str]) -> float:
    async with _slot(server, _ctx(said)):
        return time.monotonic()


async def _until(said: list[str]) -> None:
    while not said:
        await asyncio.sleep(0.01)


def test_a_waiting_call_takes_the_slot_given_back_or_lapsed(
    agentq_env, redis_server, monkeypatch
) -> None:
    # A missed message is caught after POLL_S: far longer here, so only a wake can pass.
    monkeypatch.setattr(cancel, "POLL_S", 60.0)
    server = McpServer(name=f"s{uuid.uuid4().hex[:6]}", url="http://127.0.0.1:1/mcp", concurrency=1)
    key = k.mcp_slots_key(server.name)
    slots = LeasedSemaphore(redis.Redis.from_url(redis_server.url), 1)

    async def main() -> float:
        watch = cancel.CancelWatch(redis_server.url)
        watch.start()  # the watch of this loop, as an I/O worker's loop host starts it
        try:
            assert slots.acquire(key, "holder", 60)
            said: list[str] = []
            entered = asyncio.create_task(_enter(server, said))
            await asyncio.wait_for(_until(said), 10)
            assert "waiting for one of 1 slots" in said[0]
            given_back = time.monotonic()
            await asyncio.to_thread(slots.release, key, "holder", wake=True)
            woken_s = await asyncio.wait_for(entered, 20) - given_back

            # A holder that died gives nothing back: its place is free at its lease's end.
            assert slots.acquire(key, "dies", 0.5)
            said = []
            lapsed = asyncio.create_task(_enter(server, said))
            await asyncio.wait_for(_until(said), 10)
            await asyncio.wait_for(lapsed, 20)  # not POLL_S: the lease's end woke it
            assert not watch._freed.get(key), "a waiter's wake was left registered"
            return woken_s
        finally:
            for task in watch._tasks:
                task.cancel()
            await asyncio.gather(*watch._tasks, return_exceptions=True)
            cancel.CancelWatch.current = None

    assert asyncio.run(main()) < 10  # the message woke it: not the 60 s lease, nor POLL_S
    assert slots.holders(key) == [], "a call's slot outlived it"


def test_a_call_cancelled_while_it_tries_gives_back_the_slot_the_try_took(
    agentq_env, redis_server, monkeypatch
) -> None:
    server = McpServer(name=f"s{uuid.uuid4().hex[:6]}", url="http://127.0.0.1:1/mcp", concurrency=1)
    key = k.mcp_slots_key(server.name)
    slots = LeasedSemaphore(redis.Redis.from_url(redis_server.url), 1)
    trying = threading.Event()
    real = LeasedSemaphore.acquire_or_wait_ms

    def slow_try(self: LeasedSemaphore, *args: Any) -> int:
        trying.set()
        time.sleep(0.3)  # the round trip the cancel lands in
        return real(self, *args)

    monkeypatch.setattr(LeasedSemaphore, "acquire_or_wait_ms", slow_try)

    async def main() -> None:
        watch = cancel.CancelWatch(redis_server.url)
        watch.start()
        try:
            call = asyncio.create_task(_enter(server, []))
            while not trying.is_set():
                await asyncio.sleep(0.01)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            assert not watch._freed.get(key), "the cancelled try's wake was left registered"
        finally:
            for task in watch._tasks:
                task.cancel()
            await asyncio.gather(*watch._tasks, return_exceptions=True)
            cancel.CancelWatch.current = None

    asyncio.run(main())
    # The try took the place after the cancel; its lease would hold it 35 s.
    deadline = time.monotonic() + 10
    while slots.holders(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots.holders(key) == [], "a cancelled call kept the slot its try took"
