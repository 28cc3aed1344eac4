"""The stream worker's event publisher: deltas that wait for a batch in flight, or for the
interval after it, join the delta before them (same round, same kind), nothing else is
merged or reordered; a round that ends takes what of its turn is not out yet (for the
write of its end) without waiting out the interval. A turn nobody follows has its deltas
held for the quiet interval, unless another event of it or its round's end comes first."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import fakeredis

from agentq import constants as k
from agentq.config import Settings
from agentq.events import bus as bus_module
from agentq.llm.publisher import Publisher as _Publisher
from agentq.llm.publisher import publish_batch as _publish
from agentq.state.store import TurnStore

Batch = dict[str, list[tuple[str, dict[str, Any]]]]


class _SlowStore:
    """Records each batch (and when it went out); the first one takes a while, as a loaded
    Redis round trip. Reports the turns in `watched` as followed (all of them if None)."""

    def __init__(self, slow: bool = True, watched: set[str] | None = None) -> None:
        self.batches: list[Batch] = []
        self.sent_at: list[float] = []
        self.watched = watched
        self.first_in = threading.Event()
        self.release = threading.Event()
        if not slow:
            self.release.set()

    def publish_many(self, batch: Batch) -> set[str]:
        self.batches.append(batch)
        self.sent_at.append(time.monotonic())
        if len(self.batches) == 1:
            self.first_in.set()
            self.release.wait(5)
        return set(batch) if self.watched is None else self.watched & set(batch)


class _Host:
    def __init__(
        self,
        interval_ms: int = 0,
        slow: bool = True,
        quiet_ms: int = 2000,
        watched: set[str] | None = None,
    ) -> None:
        self.store = _SlowStore(slow, watched)
        self.settings = Settings(
            llm_delta_interval_ms=interval_ms, llm_quiet_delta_interval_ms=quiet_ms
        )

    async def io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def publisher(self) -> _Publisher:
        return _Publisher(self, self.store.publish_many)  # type: ignore[arg-type]


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def _delta(round_no: int, kind: str, text: str) -> dict[str, Any]:
    return {"round_no": round_no, "kind": kind, "text": text}


def test_deltas_behind_a_batch_in_flight_are_joined_in_order() -> None:
    host = _Host()

    async def main() -> None:
        pub = host.publisher()
        pub.add("t1", "llm_started", {"round_no": 0})
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        await asyncio.get_running_loop().run_in_executor(None, host.store.first_in.wait, 5)
        # The first batch is still going out: these wait for the next one.
        for piece in ("b", "c"):
            pub.add("t1", "llm_delta", _delta(0, "text", piece))
        pub.add("t1", "llm_delta", _delta(0, "reasoning", "r"))
        pub.add("t1", "llm_delta", _delta(0, "text", "d"))
        pub.add("t2", "llm_delta", _delta(1, "text", "x"))
        pub.add("t2", "llm_delta", _delta(1, "text", "y"))
        pub.add("t1", "llm_finished", {"round_no": 0})
        host.store.release.set()
        # Each waits for the batch in flight; the loop sent what came meanwhile on.
        taken.append(await asyncio.wait_for(pub.take("t1"), 5))
        taken.append(await asyncio.wait_for(pub.take("t2"), 5))

    taken: list[list[tuple[str, dict[str, Any]]]] = []
    asyncio.run(main())
    assert taken == [[], []]
    first, second = host.store.batches
    # With nothing in flight, each event went out as it came.
    assert first == {
        "t1": [("llm_started", {"round_no": 0}), ("llm_delta", _delta(0, "text", "a"))]
    }
    assert second == {
        "t1": [
            ("llm_delta", _delta(0, "text", "bc")),
            ("llm_delta", _delta(0, "reasoning", "r")),
            ("llm_delta", _delta(0, "text", "d")),
            ("llm_finished", {"round_no": 0}),
        ],
        "t2": [("llm_delta", _delta(1, "text", "xy"))],
    }


def test_deltas_within_the_interval_join_and_a_round_end_does_not_wait_it_out() -> None:
    host = _Host(interval_ms=60_000, slow=False)
    waited_s: list[float] = []

    async def main() -> None:
        pub = host.publisher()
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        await asyncio.get_running_loop().run_in_executor(None, host.store.first_in.wait, 5)
        # Published and waiting out the interval: these join into one delta.
        for piece in ("b", "c", "d"):
            pub.add("t1", "llm_delta", _delta(0, "text", piece))
        pub.add("t1", "llm_finished", {"round_no": 0})
        t0 = time.monotonic()
        taken.extend(await asyncio.wait_for(pub.take("t1"), 5))
        waited_s.append(time.monotonic() - t0)

    taken: list[tuple[str, dict[str, Any]]] = []
    asyncio.run(main())
    assert host.store.batches == [{"t1": [("llm_delta", _delta(0, "text", "a"))]}]
    # For the round's last write, in order, joined:
    assert taken == [("llm_delta", _delta(0, "text", "bcd")), ("llm_finished", {"round_no": 0})]
    assert waited_s[0] < 5  # not the minute of the interval


def _types(batch_events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [type_ for type_, _ in batch_events]


def test_an_unwatched_turns_deltas_wait_out_the_quiet_interval() -> None:
    quiet_s = 0.5
    host = _Host(interval_ms=20, slow=False, quiet_ms=int(quiet_s * 1000), watched={"seen"})

    async def main() -> None:
        pub = host.publisher()
        # Each turn's first event goes at once, before anything is known of it.
        pub.add("quiet", "llm_started", {"round_no": 0})
        pub.add("seen", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        # A chunk every few ms for both, for longer than the quiet interval.
        for i in range(60):
            pub.add("quiet", "llm_delta", _delta(0, "text", f"q{i} "))
            pub.add("seen", "llm_delta", _delta(0, "text", f"s{i} "))
            await asyncio.sleep(0.01)
        await _until(lambda: any("quiet" in b for b in host.store.batches[1:]))
        pub.add("quiet", "llm_finished", {"round_no": 0})
        taken.extend(await asyncio.wait_for(pub.take("quiet"), 5))

    taken: list[tuple[str, dict[str, Any]]] = []
    asyncio.run(main())
    batches, sent_at = host.store.batches, host.store.sent_at
    quiet = [(b["quiet"], at) for b, at in zip(batches, sent_at, strict=True) if "quiet" in b]
    seen = [b["seen"] for b in batches if "seen" in b]
    # The watched turn goes at the normal interval: many deltas; the other, once a quiet
    # interval, and then with its end (the llm_finished came: it takes them along, out
    # at once or in what the round's end took).
    assert len(seen) > 10
    assert [_types(evs) for evs, _ in quiet][:2] == [["llm_started"], ["llm_delta"]]
    rest = [e for evs, _ in quiet[2:] for e in evs] + taken
    assert _types(rest) in (["llm_delta", "llm_finished"], ["llm_finished"])
    # Well over the 20 ms interval; not all of quiet_s, as the store's clock is read when the
    # batch lands, and the first landed some ms after the publisher's clock began (on a
    # loaded machine, 488 ms of 500 apart).
    assert quiet[1][1] - quiet[0][1] >= quiet_s * 0.8
    text = "".join(f["text"] for evs, _ in quiet for t, f in evs if t == "llm_delta")
    text += "".join(f["text"] for t, f in taken if t == "llm_delta")
    assert text == "".join(f"q{i} " for i in range(60))


def test_the_loop_sleeps_while_only_held_deltas_wait() -> None:
    host = _Host(slow=False, quiet_ms=1000, watched=set())
    looked: list[float] = []

    async def main() -> None:
        pub = host.publisher()
        take = pub._take

        def counted(now: float, skip: Any = ()) -> Any:
            if not skip:  # the loop's looks, not those of the interval after a batch
                looked.append(now)
            return take(now, skip)

        pub._take = counted  # type: ignore[method-assign]
        for t in turns:
            pub.add(t, "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        for i in range(20):
            for t in turns:
                # Reasoning, then text: each one a delta of its own, not joined.
                pub.add(t, "llm_delta", _delta(0, "reasoning" if i < 10 else "text", str(i)))
                # Chunks of many streams, each in a callback of its own.
                await asyncio.sleep(0.001)
        await _until(lambda: len(host.store.batches) == 2)
        for t in turns:
            assert await asyncio.wait_for(pub.take(t), 5) == []

    turns = [f"t{n}" for n in range(10)]
    asyncio.run(main())
    assert host.store.batches[1] == {
        t: [
            ("llm_delta", _delta(0, "reasoning", "".join(str(i) for i in range(10)))),
            ("llm_delta", _delta(0, "text", "".join(str(i) for i in range(10, 20)))),
        ]
        for t in turns
    }
    # The first batch, the look that found only held deltas, the one when they were due
    # (and one to spare, for a timer that fires a hair early): no look per turn or chunk,
    # and no busy loop.
    assert len(looked) <= 5, len(looked)


def test_another_event_of_the_turn_takes_its_held_deltas_along_first() -> None:
    host = _Host(slow=False, quiet_ms=60_000, watched=set())

    async def main() -> None:
        pub = host.publisher()
        pub.add("t1", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        pub.add("t1", "llm_delta", _delta(0, "reasoning", "r"))
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        pub.add("t1", "llm_delta", _delta(0, "text", "b"))
        # The loop has looked at them and holds them: nothing else is pending.
        await _until(lambda: pub.holding_until is not None)
        assert len(host.store.batches) == 1
        t0 = time.monotonic()
        pub.add("t1", "llm_retry", {"round_no": 0, "attempt": 1})
        await _until(lambda: len(host.store.batches) == 2)
        assert time.monotonic() - t0 < 5  # not the minute of the quiet interval
        assert await asyncio.wait_for(pub.take("t1"), 5) == []

    asyncio.run(main())
    assert host.store.batches[1] == {
        "t1": [
            ("llm_delta", _delta(0, "reasoning", "r")),
            ("llm_delta", _delta(0, "text", "ab")),
            ("llm_retry", {"round_no": 0, "attempt": 1}),
        ]
    }


def test_take_takes_held_deltas_out_and_forgets_the_turn() -> None:
    host = _Host(slow=False, quiet_ms=60_000, watched=set())

    async def main() -> None:
        pub = host.publisher()
        pub.add("t1", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        assert pub.seen["t1"].watched is False
        for piece in ("a", "b"):
            pub.add("t1", "llm_delta", _delta(0, "text", piece))
        await _until(lambda: pub.holding_until is not None)
        taken = await asyncio.wait_for(pub.take("t1"), 5)
        assert taken == [("llm_delta", _delta(0, "text", "ab"))]
        assert len(host.store.batches) == 1
        # The round is over: nothing of the turn is kept (its next round learns afresh).
        assert (pub.pending, pub.seen) == ({}, {})
        await asyncio.wait_for(pub.flushing, 5)  # type: ignore[arg-type]
        # Its next round's first event goes at once, its deltas are held again.
        pub.add("t1", "llm_started", {"round_no": 1})
        await _until(lambda: len(host.store.batches) == 2)
        pub.add("t1", "llm_delta", _delta(1, "text", "c"))
        await _until(lambda: pub.holding_until is not None)
        assert await asyncio.wait_for(pub.take("t1"), 5) == [("llm_delta", _delta(1, "text", "c"))]

    asyncio.run(main())
    assert host.store.batches[1:] == [{"t1": [("llm_started", {"round_no": 1})]}]


def test_what_a_claim_learned_holds_the_deltas_from_the_first() -> None:
    host = _Host(slow=False, quiet_ms=60_000, watched=set())

    async def main() -> None:
        pub = host.publisher()
        # The round's claim published llm_started and found nobody following.
        pub.learned("t1", False)
        pub.learned("t2", True)
        for t in ("t1", "t2"):
            pub.add(t, "llm_delta", _delta(0, "text", "a"))
        await _until(lambda: len(host.store.batches) == 1)
        await _until(lambda: pub.holding_until is not None)
        taken.extend(await asyncio.wait_for(pub.take("t1"), 5))

    taken: list[tuple[str, dict[str, Any]]] = []
    asyncio.run(main())
    assert host.store.batches == [{"t2": [("llm_delta", _delta(0, "text", "a"))]}]
    assert taken == [("llm_delta", _delta(0, "text", "a"))]


def test_a_watched_turn_pending_beside_held_ones_goes_at_once() -> None:
    host = _Host(slow=False, quiet_ms=60_000, watched={"w"})

    async def main() -> None:
        pub = host.publisher()
        pub.add("q", "llm_started", {"round_no": 0})
        pub.add("w", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        pub.add("q", "llm_delta", _delta(0, "text", "held"))
        await _until(lambda: pub.holding_until is not None)
        # The loop sleeps for a minute on the held delta: this one wakes it.
        pub.add("w", "llm_delta", _delta(0, "text", "live"))
        await _until(lambda: len(host.store.batches) == 2)
        # A turn never published (its first event) wakes it too.
        pub.add("new", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 3)
        await _until(lambda: pub.holding_until is not None)
        assert await asyncio.wait_for(pub.take("q"), 5) == [
            ("llm_delta", _delta(0, "text", "held"))
        ]

    asyncio.run(main())
    assert host.store.batches[1:] == [
        {"w": [("llm_delta", _delta(0, "text", "live"))]},
        {"new": [("llm_started", {"round_no": 0})]},
    ]


def test_no_quiet_interval_holds_nothing() -> None:
    async def main(host: _Host) -> None:
        pub = host.publisher()
        assert pub.quiet_s == 0
        pub.add("t1", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        await _until(lambda: len(host.store.batches) == 2)
        assert pub.seen == {}

    # 0, or an interval not above the watched one: every turn as if followed.
    asyncio.run(main(_Host(slow=False, quiet_ms=0, watched=set())))
    asyncio.run(main(_Host(interval_ms=250, slow=False, quiet_ms=250, watched=set())))


def test_turns_not_published_for_the_quiet_interval_are_forgotten() -> None:
    quiet_s = 0.2
    host = _Host(slow=False, quiet_ms=int(quiet_s * 1000), watched=set())

    async def main() -> None:
        pub = host.publisher()
        for i in range(50):
            pub.add(f"gone{i}", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 1)
        assert len(pub.seen) == 50
        # No take came for them (a round that never ended here): once their quiet
        # interval is over, holding nothing is what is known of them anyway.
        await asyncio.sleep(quiet_s - (time.monotonic() - host.store.sent_at[0]) + 0.01)
        pub.add("t1", "llm_started", {"round_no": 0})
        await _until(lambda: len(host.store.batches) == 2)
        await _until(lambda: "t1" in pub.seen)
        assert set(pub.seen) == {"t1"}

    asyncio.run(main())


def test_publish_many_reports_the_followed_turns_in_one_call_or_many() -> None:
    store = TurnStore(fakeredis.FakeRedis())
    for t in ("watched", "unwatched", "ended", "unmarked"):
        store.create(t, {"status": "running"}, [{"role": "user", "content": t}])
    store.bus.watch("watched", 1)
    store.bus.watch("ended", 1)
    store.bus.watch("unmarked", 1)
    store.bus.watch("unmarked", -1)
    store.redis.hset(k.turn_key("ended"), "status", json.dumps("finished"))
    few: Batch = {
        t: [("llm_delta", _delta(0, "text", "x"))]
        for t in ("unwatched", "watched", "ended", "unmarked")
    }
    assert _publish(store, few) == {"watched"}
    # More than one script call's worth, pipelined: each call's answer maps back.
    n = bus_module.PUBLISH_MANY_EVENTS + 20
    many: Batch = {
        "unwatched": [("llm_delta", _delta(0, "text", str(i))) for i in range(n)],
        "watched": [("llm_delta", _delta(0, "text", str(i))) for i in range(n)],
        "ended": [("llm_delta", _delta(0, "text", "late"))],
    }
    assert _publish(store, many) == {"watched"}
    assert [len(store.bus.replay(t)) for t in ("unwatched", "watched", "ended")] == [
        n + 1,
        n + 1,
        0,
    ]
    assert _publish(store, {}) == set()


def test_a_follower_that_comes_releases_the_held_deltas() -> None:
    host = _Host(slow=False, quiet_ms=60_000, watched=set())

    async def main() -> None:
        pub = host.publisher()
        pub.learned("t1", False)  # nobody followed when the round was claimed
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        pub.add("t1", "llm_delta", _delta(0, "text", "b"))
        await _until(lambda: pub.holding_until is not None)
        assert host.store.batches == []
        host.store.watched = {"t1"}  # a follower marks the turn in Redis ...
        pub.watched("t1")  # ... which the watch channel tells
        await _until(lambda: len(host.store.batches) == 1)
        # A claim's older knowledge does not undo it.
        pub.learned("t1", False)
        pub.add("t1", "llm_delta", _delta(0, "text", "c"))
        await _until(lambda: len(host.store.batches) == 2)

    asyncio.run(main())
    assert host.store.batches == [
        {"t1": [("llm_delta", _delta(0, "text", "ab"))]},
        {"t1": [("llm_delta", _delta(0, "text", "c"))]},
    ]


def test_a_new_rounds_first_delta_does_not_wait_out_another_turns_interval() -> None:
    host = _Host(interval_ms=60_000, slow=False)

    async def main() -> None:
        pub = host.publisher()
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        await _until(lambda: len(host.store.batches) == 1)
        # The loop waits out t1's interval; t2's first chunk goes at once, t1's joins.
        pub.add("t1", "llm_delta", _delta(0, "text", "b"))
        pub.add("t2", "llm_delta", _delta(1, "text", "x"))
        await _until(lambda: len(host.store.batches) == 2)
        # t2 is in this interval now: its next chunk joins too.
        pub.add("t2", "llm_delta", _delta(1, "text", "y"))
        taken.extend(await asyncio.wait_for(pub.take("t1"), 5))
        taken.extend(await asyncio.wait_for(pub.take("t2"), 5))

    taken: list[tuple[str, dict[str, Any]]] = []
    asyncio.run(main())
    assert host.store.batches == [
        {"t1": [("llm_delta", _delta(0, "text", "a"))]},
        {"t2": [("llm_delta", _delta(1, "text", "x"))]},
    ]
    assert taken == [("llm_delta", _delta(0, "text", "b")), ("llm_delta", _delta(1, "text", "y"))]
