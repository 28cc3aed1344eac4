"""The asyncio client: waiting holds no thread (XREAD BLOCK on `redis.asyncio`, the
sub-agents' logs in the same command); starts, aborts and final reads run on two threads,
so a burst of starts competes with the loop for the GIL from two, not a pool's dozens."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from agentq.api import DEFAULT_TIMEOUT_S, Client, Turn, _Started
from agentq.config import Settings, get_settings
from agentq.constants import turn_key
from agentq.errors import ConfigError, TurnNotFound, TurnTimeout
from agentq.events import Event
from agentq.events.follow import PAGE, Cursor, Marks, Relay
from agentq.fleet.connections import async_redis_client
from agentq.state.results import TurnResult, settle

if TYPE_CHECKING:
    from typing import Unpack

    from agentq.agents import Agent
    from agentq.api import StartOptions

P = ParamSpec("P")
R = TypeVar("R")

SYNC_THREADS = 2
MAX_CONNECTIONS = 4096
"""Redis connections of one AsyncClient: each turn waited for or followed holds one."""


def _threaded(
    method: Callable[Concatenate[Client, P], R],
) -> Callable[Concatenate[AsyncClient, P], Awaitable[R]]:
    """`Client`'s method as a coroutine run on the client's threads."""

    async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._call(method, self._client, *args, **kwargs)

    call.__doc__ = method.__doc__
    return call


def _starts(
    method: Callable[Concatenate[Client, P], Turn],
) -> Callable[Concatenate[AsyncClient, P], Awaitable[AsyncTurn]]:
    """`_threaded` for a method that starts a turn: its `AsyncTurn`."""

    async def call(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> AsyncTurn:
        turn = await self._call(method, self._client, *args, **kwargs)
        return AsyncTurn(self, turn.handle, turn._output_type)

    call.__doc__ = method.__doc__
    return call


class AsyncClient:
    """`Client` for asyncio code: `async with AsyncClient() as client: await client.run(...)`."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        if self.settings.redis_cluster_nodes:
            raise ConfigError(
                "AGENTQ_REDIS_CLUSTER_NODES",
                "the asyncio client does not follow a Redis Cluster yet",
            )
        self._redis = async_redis_client(
            self.settings.redis_url,
            self.settings.redis_sentinel_master,
            max_connections=MAX_CONNECTIONS,
        )
        self._client: Client = Client(self.settings)
        self._threads = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="agentq-aclient")

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._redis.aclose()
        self._threads.shutdown(wait=False)

    async def _call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    async def run(
        self,
        agent: Agent | str | None,
        prompt: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **options: Unpack[StartOptions],
    ) -> TurnResult:
        """`Client.run`: start a turn and wait for its result (or its typed error)."""
        turn = await self.start(agent, prompt, **options)
        return await turn.result(timeout_s)

    async def events(
        self,
        turn_id: str,
        *,
        after_id: str = "0-0",
        depth: int = 1,
        heartbeat_s: float | None = None,
    ) -> AsyncGenerator[Event | None, None]:
        """`Client.events`."""
        if not await self._redis.exists(turn_key(turn_id)):
            raise TurnNotFound(turn_id)
        block_ms = max(1, int((heartbeat_s or 5.0) * 1000))
        after = Cursor.parse(after_id)
        relay = Relay(turn_id, after=after, depth=depth)
        # On a thread: one walk up per child at a resume, not worth an asyncio twin.
        await self._call(relay.resume, self._client._store.redis, after)
        marks = Marks(self._client._store.bus)
        try:
            while not relay.done:
                if marks.due(relay.streams.keys()):
                    await self._call(marks.keep, list(relay.streams))
                reply: Any = await self._redis.xread(relay.positions(), count=PAGE, block=block_ms)
                if reply:
                    for ev in relay.take(reply, PAGE):
                        yield ev
                elif heartbeat_s is not None:
                    yield None
        finally:
            with contextlib.suppress(RuntimeError):  # the client's threads are gone
                self._threads.submit(marks.clear)

    async def wait(self, turn_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Event:
        """`Client.wait`, without the warning."""
        deadline = time.monotonic() + timeout_s
        beat_s = min(1.0, max(timeout_s, 0.01))
        # Closed here, not by the loop's finalizer: the follower counts itself out at once.
        async with contextlib.aclosing(self.events(turn_id, depth=0, heartbeat_s=beat_s)) as evs:
            async for ev in evs:
                if ev is not None and ev.ends_turn:
                    return ev
                if time.monotonic() > deadline:
                    break
        raise TurnTimeout(turn_id, timeout_s)

    start = _starts(Client.start)
    retry = _starts(Client.retry)
    fork = _starts(Client.fork)
    get = _threaded(Client.get)
    abort = _threaded(Client.abort)
    answer = _threaded(Client.answer)
    complete_waitpoint = _threaded(Client.complete_waitpoint)


class AsyncTurn(_Started[Awaitable[None]]):
    """`Turn` for asyncio code: `async for ev in turn.events()`, `await turn.result()`."""

    _client: AsyncClient

    async def events(self, *, depth: int = 1, after_id: str = "0-0") -> AsyncIterator[Event]:
        """`Client.events` without heartbeats."""
        async for ev in self._client.events(self.turn_id, after_id=after_id, depth=depth):
            if ev is not None:
                yield ev

    async def result(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> TurnResult:
        """`Turn.result`."""
        terminal = await self._client.wait(self.turn_id, timeout_s)
        view = await self._client.get(self.turn_id)
        return settle(self.turn_id, terminal, view, self._output_type)


__all__ = ["AsyncClient", "AsyncTurn"]
