"""The wakeup sweeper's index pruning (orchestrator/steps.py)."""

from __future__ import annotations

import fakeredis

from agentq import constants as k
from agentq.state.store import TurnStore


def test_the_sweeper_drops_index_entries_of_expired_turns_and_keeps_live_ones() -> None:
    from agentq.config import Settings
    from agentq.orchestrator.steps import PRUNE_BATCH, Sweeper

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    now = 1_000_000.0
    retention_s = 3600
    old = now - retention_s - 10
    # More expired entries than one batch, with live old turns among them.
    expired = [f"gone{i}" for i in range(PRUNE_BATCH + 120)]
    live = [f"live{i}" for i in range(PRUNE_BATCH + 5)]
    r.zadd(k.TURNS_INDEX, {t: old - i for i, t in enumerate(live)})
    r.zadd(k.TURNS_INDEX, {t: old + i * 0.001 for i, t in enumerate(expired)})
    r.zadd(k.TURNS_INDEX, {"recent": now - 5})
    for t in live:
        r.hset(k.turn_key(t), "status", "running")
    sweeper = Sweeper(store, None, Settings(turn_retention_s=retention_s))  # type: ignore[arg-type]
    assert sweeper.prune_index(now) == len(expired)
    left = {m.decode() for m in r.zrange(k.TURNS_INDEX, 0, -1)}
    assert left == {*live, "recent"}


def test_pruning_pages_past_live_entries_that_share_one_score() -> None:
    from agentq.config import Settings
    from agentq.orchestrator.steps import PRUNE_BATCH, Sweeper

    r = fakeredis.FakeRedis()
    now = 1_000_000.0
    old = now - 7200
    live = [f"a{i:04}" for i in range(PRUNE_BATCH + 3)]  # sorted before the expired ones
    r.zadd(k.TURNS_INDEX, {t: old for t in [*live, "b1", "b2"]})
    for t in live:
        r.hset(k.turn_key(t), "status", "running")
    sweeper = Sweeper(TurnStore(r), None, Settings(turn_retention_s=3600))  # type: ignore[arg-type]
    assert sweeper.prune_index(now) == 2
    assert r.zcard(k.TURNS_INDEX) == len(live)


def test_the_sweeper_waits_only_until_the_next_wakeup_comes_due() -> None:
    # A queued model round's turn asks for its slot at that moment, not up to a sweep
    # interval late: a configured fleet lost a fifth of the provider's slots every other
    # second to that lateness.
    from agentq.config import Settings
    from agentq.orchestrator.steps import MIN_SWEEP_WAIT_S, Sweeper

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    sweeper = Sweeper(store, None, Settings(sweep_interval_s=0.25))  # type: ignore[arg-type]
    now = 1_000_000.0

    def wait_s() -> float:
        return sweeper.until_next_s(now, sweeper.look(now).next_at)

    assert wait_s() == 0.25  # nothing waits
    r.zadd(k.WAKEUPS, {"open": float("inf"), "later": now + 5})
    assert wait_s() == 0.25
    r.zadd(k.WAKEUPS, {"soon": now + 0.1, "due": now - 1})  # `due`: this pass's, not the next
    assert abs(wait_s() - 0.1) < 1e-6
    assert sweeper.look(now).wakeups == ["due"]
    r.zadd(k.WAKEUPS, {"at-once": now + 0.001})
    assert wait_s() == MIN_SWEEP_WAIT_S


def test_a_pass_that_took_a_full_batch_of_due_wakeups_sweeps_again_at_once() -> None:
    from agentq.config import Settings
    from agentq.orchestrator.steps import DUE_PER_PASS, MIN_SWEEP_WAIT_S, Sweeper

    r = fakeredis.FakeRedis()
    sweeper = Sweeper(TurnStore(r), None, Settings(sweep_interval_s=0.25))  # type: ignore[arg-type]
    now = 1_000_000.0
    r.zadd(k.WAKEUPS, {f"t{i}": now - 1 for i in range(DUE_PER_PASS + 1)})
    look = sweeper.look(now)
    assert len(look.wakeups) == DUE_PER_PASS
    assert sweeper.until_next_s(now, look.next_at) == MIN_SWEEP_WAIT_S
    r.zrem(k.WAKEUPS, "t0", "t1")
    assert sweeper.until_next_s(now, sweeper.look(now).next_at) == 0.25


def test_an_abort_escalation_is_sent_once_when_due_and_the_sweeper_wakes_for_it() -> None:
    from agentq.config import Settings
    from agentq.orchestrator.steps import Sweeper, send_kills

    sent: list[tuple[str, dict[str, object], object]] = []

    class Control:
        def broadcast(self, command: str, arguments: dict[str, object], destination: object):
            sent.append((command, arguments, destination))

    class App:
        control = Control()

    r = fakeredis.FakeRedis()
    now = 1_000_000.0
    order = '{"targets":[["t1",42]],"to":["tools@h"]}'
    r.zadd(k.KILLS, {order: now + 0.5})
    sweeper = Sweeper(TurnStore(r), App(), Settings(sweep_interval_s=0.25))  # type: ignore[arg-type]
    look = sweeper.look(now + 0.4)
    assert look.kills == [] and abs(sweeper.until_next_s(now + 0.4, look.next_at) - 0.1) < 1e-6
    due = sweeper.look(now + 0.5).kills
    assert due == [order.encode()]
    # Two sweepers that both found it due: one sends it.
    assert send_kills(r, App(), due) + send_kills(r, App(), due) == 1  # type: ignore[arg-type]
    assert sent == [("agentq_kill", {"targets": [["t1", 42]]}, ["tools@h"])]
    assert r.zcard(k.KILLS) == 0
