"""The batch in flight's count (constants.UNSETTLED_FIELD), on a real Redis, over random
sequences of what moves it: a step sends calls (new, or sent again) as it lets go of its
lock, agent calls recorded apart, workers settle calls (first result wins, settled again
by a second writer), the turn settles calls it never sent (refused), and a step takes
back calls it could not send (the broker went away).

The invariant: the count is the number of calls recorded as sent and not settled, after
every write. The settle that brings it to 0 is the one that wakes the turn; a count that
drifts leaves a turn asleep or wakes it a batch early.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from agentq import constants as k
from agentq.local.redis_server import RedisServer
from agentq.models import ToolCall
from agentq.state.steplock import Released
from agentq.state.store import TurnStore
from agentq.tools.results import denied_result, error_result

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        yield redis.Redis.from_url(server.url)


class UnsettledCount(RuleBasedStateMachine):
    """One turn per run; the model is the set of calls recorded as sent and the set of
    calls settled."""

    client: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.store = TurnStore(self.client)
        self.turn_id = secrets.token_hex(16)
        self.sent: dict[str, dict[str, Any]] = {}
        """Call id -> its dispatch record, as recorded."""
        self.settled: set[str] = set()
        self.last_batch: dict[str, dict[str, Any]] = {}
        """The records the last step sent, which it may take back (none once anything
        else happened: a step takes back only what it could not send just now)."""
        self.n = 0

    @initialize()
    def new_turn(self) -> None:
        self.store.create(self.turn_id, {"status": "running"}, [{"role": "user", "content": "x"}])

    def _new_ids(self, n: int) -> list[str]:
        ids = [f"c{self.n + i}" for i in range(n)]
        self.n += n
        return ids

    @rule(new=st.integers(0, 4), again=st.integers(0, 2))
    def a_step_sends_calls(self, new: int, again: int) -> None:
        token = secrets.token_hex(4)
        # A step begins (its read clears the wake mark a settle left), then sends.
        assert self.store.begin_step(self.turn_id, token, 10_000) is not None
        records = {c: {"task_id": f"{c}.1", "sends": 1} for c in self._new_ids(new)}
        # Calls recorded before and not settled are sent again (the pickup): not counted twice.
        out = [c for c in self.sent if c not in self.settled][:again]
        for c in out:
            records[c] = {**self.sent[c], "sends": int(self.sent[c]["sends"]) + 1}
        released = self.store.release_step(self.turn_id, token, None, 10_000, records)
        assert released is Released.RELEASED
        self.sent.update(records)
        self.last_batch = records

    @rule(n=st.integers(1, 3))
    def agent_calls_are_recorded_apart(self, n: int) -> None:
        records = {c: {"task_id": "", "sends": 1} for c in self._new_ids(n)}
        self.store.record_dispatch(self.turn_id, records)
        self.sent.update(records)
        self.last_batch = {}

    @precondition(lambda self: any(c not in self.settled for c in self.sent))
    @rule(data=st.data())
    def a_worker_settles_a_call(self, data: st.DataObject) -> None:
        open_calls = sorted(c for c in self.sent if c not in self.settled)
        cid = data.draw(st.sampled_from(open_calls))
        assert self.store.settle(self.turn_id, error_result(ToolCall(id=cid, name="t"), "x"))
        self.settled.add(cid)
        self.last_batch = {}

    @precondition(lambda self: bool(self.settled))
    @rule(data=st.data())
    def a_second_writer_settles_a_settled_call(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.settled)))
        late = error_result(ToolCall(id=cid, name="t"), "late")
        assert not self.store.settle(self.turn_id, late, wake=False)
        self.last_batch = {}

    @rule()
    def the_turn_settles_a_call_it_never_sent(self) -> None:
        (cid,) = self._new_ids(1)
        refused = denied_result(ToolCall(id=cid, name="t"), "policy")
        assert self.store.settle(self.turn_id, refused, wake=False, tracked=False)
        self.settled.add(cid)
        self.last_batch = {}

    @precondition(lambda self: bool(self.last_batch))
    @rule()
    def the_step_takes_back_what_it_could_not_send(self) -> None:
        batch = self.last_batch
        self.store.unrecord(self.turn_id, batch)
        for c, rec in batch.items():
            if int(rec["sends"]) == 1:
                del self.sent[c]
            else:
                self.sent[c] = {**rec, "sends": int(rec["sends"]) - 1}
        self.last_batch = {}

    @invariant()
    def the_count_is_the_calls_sent_and_not_settled(self) -> None:
        raw = self.client.hget(k.turn_key(self.turn_id), k.UNSETTLED_FIELD)
        stored = int(raw or 0)
        expected = sum(1 for c in self.sent if c not in self.settled)
        assert stored == expected, f"unsettled is {stored}, {expected} calls are out"


def test_the_unsettled_count_is_the_calls_out(client: redis.Redis) -> None:
    UnsettledCount.client = client
    run_state_machine_as_test(
        UnsettledCount,
        settings=settings(
            max_examples=60,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
