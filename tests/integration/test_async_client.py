"""`AsyncClient` through real workers: the sync client's surface as coroutines, and 200
turns from one event loop at once without blocking it."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest

from agentq import AsyncClient, AsyncTurn, TurnAborted, TurnFailed, TurnNotFound, TurnTimeout
from agentq.constants import turn_key
from agentq.events import Event, ToolStarted, TurnFinished
from agentq.events.bus import WATCHERS_FIELD
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.agents_under_test import Verdict
from tests.helpers import calls, collect, script, script_asking_echoer

pytestmark = pytest.mark.integration


def test_two_hundred_turns_from_one_loop_never_block_it(fleet, llm_server, agentq_env) -> None:
    key = script(llm_server, Round(tool_calls=calls(("echo", {"text": "hi"}))), Round(text="done"))

    async def main() -> tuple[list[str], list[float]]:
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            # How late the loop runs a 10 ms timer: a blocked loop shows as a long lag.
            while not stop.is_set():
                t0 = time.monotonic()
                await asyncio.sleep(0.01)
                lags.append(time.monotonic() - t0 - 0.01)

        async with AsyncClient() as client:
            tick = asyncio.create_task(ticker())
            results = await asyncio.gather(
                *(client.run(None, f"{key} #{i}", timeout_s=120) for i in range(200))
            )
            stop.set()
            await tick
        return [r.text for r in results], sorted(lags)

    texts, lags = asyncio.run(main())
    assert texts == ["done"] * 200
    # A loop blocked on one wait would be late by a turn's whole duration, turn after turn;
    # on a 2-core machine the fleet's processes alone delay a timer by some 100 ms, and by
    # seconds when the machine runs other work too.
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert lags[len(lags) // 2] < 0.05 * busy, (lags[len(lags) // 2], busy)
    assert lags[-1] < 1.0 * busy, (lags[-1], busy)


def test_an_async_turn_streams_typed_events_aborts_and_raises(fleet, llm_server) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 30}))))

    async def main() -> None:
        async with AsyncClient() as client:
            turn = await client.start(None, key)
            assert isinstance(turn, AsyncTurn) and turn.token
            with pytest.raises(TurnTimeout):
                await turn.result(timeout_s=0.2)
            types = []
            async for ev in turn.events():
                types.append(ev.type)
                if isinstance(ev, ToolStarted):
                    await turn.abort()
            assert types[0] == "turn_started" and types[-1] == "turn_aborted"
            with pytest.raises(TurnAborted):
                await turn.result(timeout_s=10)

    asyncio.run(main())


def test_async_run_types_the_output_and_fails_typed(fleet, llm_server) -> None:
    good = script(llm_server, Round(text='{"answer": "no", "confidence": 1}'))
    bad = script(llm_server, Round(text="?"), Round(text="??"))

    async def main() -> None:
        async with AsyncClient() as client:
            result = await client.run("t_judge", good, timeout_s=30)
            assert result.output == Verdict(answer="no", confidence=1)
            with pytest.raises(TurnFailed) as err:
                await client.run("t_judge", bad, timeout_s=30)
            assert err.value.error_code == "invalid_output"
            events = [ev async for ev in (await client.start(None, good)).events()]
            assert isinstance(events[-1], TurnFinished) and events[-1].ends_turn

    asyncio.run(main())


def test_async_events_relay_a_child_turn_with_its_path(fleet, llm_server, client) -> None:
    key = script_asking_echoer(llm_server, Round(text="child"))
    parent = client._start_turn(key, agent="t_boss")

    async def main() -> list[Event]:
        async with AsyncClient() as aclient:
            return [ev async for ev in aclient.events(parent.turn_id) if ev is not None]

    events = asyncio.run(main())
    child = next(e.turn_id for e in events if e.path)
    assert {tuple(e.path) for e in events if e.path} == {(child,)}
    assert [e.type for e in events if e.path] == [e.type for e in collect(client, child, depth=0)]
    assert [e.type for e in events if not e.path] == [
        e.type for e in collect(client, parent.turn_id, depth=0)
    ]
    assert events[-1].type == "turn_finished" and not events[-1].path


def test_async_events_carry_a_cursor_that_resumes_either_client(fleet, llm_server, client) -> None:
    # The cursor names the child's stream while it is open: a resume from the middle of the
    # child's events reads the rest of both streams, from the async and the sync client alike.
    key = script_asking_echoer(llm_server, Round(text="child"))
    parent = client._start_turn(key, agent="t_boss")

    async def read(after_id: str = "0-0") -> list[Event]:
        async with AsyncClient() as aclient:
            got = aclient.events(parent.turn_id, after_id=after_id)
            return [ev async for ev in got if ev is not None]

    events = asyncio.run(read())
    assert all(e.cursor for e in events)
    mid = next(i for i, e in enumerate(events) if e.path and e.type == "llm_started")
    cursor = events[mid].cursor or ""
    assert f",{events[mid].turn_id}=" in cursor, cursor
    sync_rest = [e for e in client.events(parent.turn_id, after_id=cursor) if e is not None]
    for side, rest in (("async", asyncio.run(read(cursor))), ("sync", sync_rest)):
        for turn_id in {e.turn_id for e in events}:
            assert [(e.type, e.seq) for e in rest if e.turn_id == turn_id] == [
                (e.type, e.seq) for e in events[mid + 1 :] if e.turn_id == turn_id
            ], (side, turn_id == parent.turn_id, [(e.type, e.path) for e in rest])
    # Read whole once it ended, both clients merge the two logs alike: within a millisecond
    # the child's end goes before its call's settling in the parent (one script).
    whole = [(e.turn_id, e.seq) for e in client.events(parent.turn_id) if e is not None]
    assert [(e.turn_id, e.seq) for e in asyncio.run(read())] == whole


def test_an_async_follower_is_counted_in_while_it_reads(client) -> None:
    # A stream worker holds back the deltas of a turn nobody follows (for
    # llm_quiet_delta_interval_ms): an async follower counts itself in, as a sync one
    # does, or it would get a streamed answer in bursts seconds apart.
    redis, turn_id = client._store.redis, uuid.uuid4().hex
    redis.hset(turn_key(turn_id), "status", '"running"')

    async def main() -> object:
        async with AsyncClient() as aclient:
            events = aclient.events(turn_id, depth=0, heartbeat_s=0.05)
            assert await anext(events) is None  # nothing published: a heartbeat
            watchers = redis.hget(turn_key(turn_id), WATCHERS_FIELD)
            await events.aclose()
            return watchers

    assert asyncio.run(main()) == b"1"
    wait_for(lambda: not redis.hexists(turn_key(turn_id), WATCHERS_FIELD), 5, 0.02)


def test_an_async_wait_counts_its_follower_out_before_it_returns(client) -> None:
    # Closed by wait itself, not by the loop's finalizer later: the check below blocks the
    # loop, so a close left to the finalizer could not run before it.
    redis, turn_id = client._store.redis, uuid.uuid4().hex
    redis.hset(turn_key(turn_id), "status", '"running"')

    async def main() -> None:
        async with AsyncClient() as aclient:
            with pytest.raises(TurnTimeout):
                await aclient.wait(turn_id, timeout_s=0.2)
            wait_for(lambda: not redis.hexists(turn_key(turn_id), WATCHERS_FIELD), 5, 0.02)

    asyncio.run(main())


def test_async_events_of_an_unknown_turn_raise_at_once(client) -> None:
    async def main() -> None:
        async with AsyncClient() as aclient:
            with pytest.raises(TurnNotFound):
                await anext(aclient.events(uuid.uuid4().hex, heartbeat_s=30))

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 10  # not after a 30 s read
