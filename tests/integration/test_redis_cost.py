"""What one no-op call costs Redis, write by write, on a real Redis: the budget behind the
bench's `cost_per_call` (docs/benchmarks.md). A change that adds a command to a call's
path fails here first, and says where."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from agentq.local.redis_server import RedisServer
from agentq.models import ToolCall, TurnStatus
from agentq.state.base import StepView
from agentq.state.store import TurnStore
from agentq.telemetry.fleetcounts import fleet_counts
from agentq.tools.results import error_result

pytestmark = pytest.mark.integration


class _Stepper:
    """Takes the step a settle hands it (as a tool process does), keeping its token."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, StepView]] = []

    def lock_ms(self) -> int | None:
        return 5000

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        self.taken.append((token, view))

    def wake(self, turn_id: str) -> None:
        raise AssertionError("a settle that takes the step sends none")


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        yield redis.Redis.from_url(server.url)


def _commands(r: redis.Redis) -> int:
    stats: dict[str, Any] = r.info("commandstats")
    return sum(int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info")


def _cost(r: redis.Redis, write: Callable[[], object]) -> int:
    before = _commands(r)
    write()
    return _commands(r) - before


def _one_call(store: TurnStore) -> tuple[str, dict[str, int]]:
    """A turn of one call, through the store as the client, the turn worker and the tool
    process drive it; the commands each write costs (scripts' commands included)."""
    r = store.redis
    turn_id, call = secrets.token_hex(16), ToolCall(id="c_1", name="noop")
    state: Any = {"status": "queued", "created_at": time.time(), "round": 1, "call_count": 1}
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None},
    ]
    cost: dict[str, int] = {}
    cost["create"] = _cost(r, lambda: store.create(turn_id, state, history))
    views: list[StepView | None] = []
    cost["open"] = _cost(r, lambda: views.append(store.begin_step(turn_id, "s1", 5000)))
    assert views[0] is not None and views[0].state is not None
    sent = {call.id: {"task_id": "t", "dispatched_at": time.time(), "tool": "noop"}}
    cost["send"] = _cost(
        r,
        lambda: store.release_step(
            turn_id,
            "s1",
            time.time() + 40,
            5000,
            sent,
            fields={"status": "running", "round_calls": [call.id]},
            events=[("turn_started", {})],
            plans={call.id: json.dumps({"call": call.model_dump()})},
        ),
    )
    start = {"started_at": time.time(), "worker": "w", "pid": 1, "task_id": "t"}
    answers: list[int] = []
    cost["start"] = _cost(
        r,
        lambda: answers.append(
            store.mark_started(turn_id, call.id, start, {"call_id": call.id, "tool": "noop"})
        ),
    )
    assert answers == [1]
    stepper = _Stepper()
    store.stepper = stepper
    try:
        cost["settle"] = _cost(r, lambda: store.settle(turn_id, error_result(call, "done")))
    finally:
        store.stepper = None
    ((token, view),) = stepper.taken
    assert view.round is not None and view.round.values[0]  # the step has the result
    tool_message = {"role": "tool", "tool_call_id": call.id, "content": "done"}
    cost["end"] = _cost(
        r,
        lambda: store.close(
            turn_id,
            TurnStatus.FINISHED,
            "turn_finished",
            {},
            token=token,
            append=[tool_message],
        ),
    )
    assert store.status(turn_id) == "finished"
    return turn_id, cost


def test_a_no_op_calls_writes_cost_the_commands_the_benchmark_counts(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's event counts go to the newest Redis they were counted for, from a
    # thread every few seconds: a flush inside a measured write is not that write's cost
    # (it once made the end cost 8). Counting costs a write no command of its own.
    monkeypatch.setattr(fleet_counts, "events", lambda *args, **kwargs: None)
    store = TurnStore(client)
    _one_call(store)  # the scripts are loaded once, by the first
    turn_id, cost = _one_call(store)
    assert cost == {
        # state (its history among it), the listing's index, the wakeup (one pipeline)
        "create": 3,
        # lock, state (its calls' records and its history among it)
        "open": 3,
        # fenced: the state with plans and records in one HSET, turn_started, the wakeup
        "send": 5,
        # the state and the call's records in one HMGET, tool_started, one HSET
        "start": 4,
        # the state and the call's records in one HMGET, tool_finished, one HSET (result,
        # step lock), the backstop, the whole state (the step it takes reads it)
        "settle": 6,
        # fenced: turn_finished, the state with the last messages, the wakeup gone, 2 TTLs
        "end": 7,
    }, cost
    # With the call's message (LPUSH and BRPOP) and the client's read of the end, 31: the
    # bench's `agentq_redis_commands_per_call`, whose caller sends the call as a stream
    # worker sends a model round's calls; 33 when a turn worker's step sends it (the
    # step's own message is two more).
    assert sum(cost.values()) + 2 + 1 == 31
    # The history the steps wrote is the turn's, in order.
    assert [m["role"] for m in store.history(turn_id)] == ["user", "assistant", "tool"]
