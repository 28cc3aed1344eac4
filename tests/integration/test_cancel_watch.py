"""The loop's cancel channel: an abort that comes before its callback is registered
still fires it, and the fallback poll finds a cancel key set without a message."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from agentq import constants as k
from agentq.aio.cancel import CancelWatch

pytestmark = pytest.mark.integration


def test_an_abort_before_the_callback_fires_it_when_it_registers() -> None:
    async def main() -> list[str]:
        watch = CancelWatch("redis://127.0.0.1:1/0")  # never started: no Redis needed
        fired: list[str] = []
        assert watch.fire("t-early") == 0  # no callback yet: remembered
        watch.add("t-early", lambda: fired.append("t-early"))
        watch.add("t-other", lambda: fired.append("t-other"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return fired

    assert asyncio.run(main()) == ["t-early"]


def test_the_poll_finds_a_cancel_key_set_without_a_message(redis_server) -> None:
    turn = f"t-{uuid.uuid4().hex[:8]}"
    quiet = f"t-{uuid.uuid4().hex[:8]}"

    async def main() -> list[str]:
        watch = CancelWatch(redis_server.url, poll_s=0.05)
        watch.start()
        fired: list[str] = []
        done = asyncio.Event()
        watch.add(turn, lambda: (fired.append(turn), done.set()))
        watch.add(quiet, lambda: fired.append(quiet))
        # The key alone, as when the message went out while the subscription was down.
        redis.Redis.from_url(redis_server.url).set(k.turn_key(turn, "cancel"), "user", ex=60)
        try:
            await asyncio.wait_for(done.wait(), 5)
        finally:
            for task in watch._tasks:
                task.cancel()
            await asyncio.gather(*watch._tasks, return_exceptions=True)
        return fired

    assert asyncio.run(main()) == [turn]
