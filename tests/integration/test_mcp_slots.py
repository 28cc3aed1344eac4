"""An MCP server's fleet-wide slots (`concurrency: N`): a call waiting for one is woken by a
slot given back or by the soonest lease's end, not by a poll; on this process's own loop
host, against a real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from agentq import constants as k
from agentq.aio import cancel
from agentq.aio.host import LoopHost, get_host
from agentq.limits.semaphore import LeasedSemaphore
from agentq.local.processes import wait_for
from agentq.mcp.servers import McpServer
from agentq.mcp.tools import _slot
from agentq.tools.context import ToolContext

pytestmark = pytest.mark.integration


@pytest.fixture
def host(agentq_env, monkeypatch) -> Iterator[LoopHost]:
    # A missed message is caught after POLL_S: far longer here, so only a wake can pass.
    monkeypatch.setattr(cancel, "POLL_S", 60.0)
    yield get_host()


def _waiter(host: LoopHost, server: McpServer, said: list[str]):
    ctx = ToolContext(
        turn_id="t" * 32,
        call_id=f"c_{uuid.uuid4().hex[:6]}",
        tool="s__t",
        started_at=time.time(),
        timeout_s=30.0,
        soft_timeout_s=None,
        on_progress=lambda message, _pct, _meta: said.append(message),
    )

    async def call() -> float:
        async with _slot(server, ctx):
            return time.monotonic()

    return asyncio.run_coroutine_threadsafe(call(), host.loop.loop)


def test_a_waiting_call_takes_the_slot_given_back_or_lapsed(host: LoopHost, redis_server) -> None:
    server = McpServer(name=f"s{uuid.uuid4().hex[:6]}", url="http://127.0.0.1:1/mcp", concurrency=1)
    key = k.mcp_slots_key(server.name)
    slots = LeasedSemaphore(redis.Redis.from_url(redis_server.url), 1)

    assert slots.acquire(key, "holder", 60)
    said: list[str] = []
    entered = _waiter(host, server, said)
    wait_for(lambda: said, 10, message="the call never said it waits for a slot")
    assert "waiting for one of 1 slots" in said[0]
    given_back = time.monotonic()
    slots.release(key, "holder", wake=True)
    assert entered.result(timeout=20) - given_back < 10  # not the 60 s lease, nor POLL_S

    # A holder that died gives nothing back: its place is free at its lease's end.
    assert slots.acquire(key, "dies", 0.5)
    said.clear()
    lapsed = _waiter(host, server, said)
    wait_for(lambda: said, 10, message="the second call never waited")
    lapsed.result(timeout=20)  # not POLL_S: the lease's end woke it
    assert slots.holders(key) == [], "a call's slot outlived it"
    assert not host.cancels._freed.get(key), "a waiter's wake was left registered"
