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
