"""The stream worker's event publisher: deltas that wait for a batch in flight, or for the
interval after it, join the delta before them (same round, same kind), nothing else is
merged or reordered; a round that ends does not wait out the interval."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agentq.config import Settings
from agentq.llm.task import _Publisher


class _SlowStore:
    """Records each batch; the first one takes a while, as a loaded Redis round trip."""

    def __init__(self, slow: bool = True) -> None:
        self.batches: list[dict[str, list[tuple[str, dict[str, Any]]]]] = []
        self.first_in = threading.Event()
        self.release = threading.Event()
        if not slow:
            self.release.set()

    def publish_many(self, batch: dict[str, list[tuple[str, dict[str, Any]]]]) -> None:
        self.batches.append(batch)
        if len(self.batches) == 1:
            self.first_in.set()
            self.release.wait(5)


class _Host:
    def __init__(self, interval_ms: int = 0, slow: bool = True) -> None:
        self.store = _SlowStore(slow)
        self.settings = Settings(llm_delta_interval_ms=interval_ms)

    async def io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _delta(round_no: int, kind: str, text: str) -> dict[str, Any]:
    return {"round_no": round_no, "kind": kind, "text": text}


def test_deltas_behind_a_batch_in_flight_are_joined_in_order() -> None:
    host = _Host()

    async def main() -> None:
        pub = _Publisher(host)  # type: ignore[arg-type]
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
        await asyncio.wait_for(pub.drain("t1"), 5)
        await asyncio.wait_for(pub.drain("t2"), 5)

    asyncio.run(main())
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
        pub = _Publisher(host)  # type: ignore[arg-type]
        pub.add("t1", "llm_delta", _delta(0, "text", "a"))
        await asyncio.get_running_loop().run_in_executor(None, host.store.first_in.wait, 5)
        # Published and waiting out the interval: these join into one delta.
        for piece in ("b", "c", "d"):
            pub.add("t1", "llm_delta", _delta(0, "text", piece))
        pub.add("t1", "llm_finished", {"round_no": 0})
        t0 = time.monotonic()
        await asyncio.wait_for(pub.drain("t1"), 5)
        waited_s.append(time.monotonic() - t0)

    asyncio.run(main())
    assert host.store.batches == [
        {"t1": [("llm_delta", _delta(0, "text", "a"))]},
        {"t1": [("llm_delta", _delta(0, "text", "bcd")), ("llm_finished", {"round_no": 0})]},
    ]
    assert waited_s[0] < 5  # not the minute of the interval: the drain cut it short
