"""Load: 200 concurrent turns of 3 tool calls each, on this machine, all settled, none lost.

Prints the wall time and every process's memory (RSS, pool children included); the
figures go into docs/reliability.md.
"""

from __future__ import annotations

import json
import time

import psutil
import pytest

from agentq import constants as k
from agentq.testing.openai_server import Round
from tests.helpers import assert_valid_history, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(150)]

TURNS = 200
RIG_CONCURRENCY = {"turns": 220, "llm": 32, "tools": 8}
BOUND_S = 120


def _rss_mb(pid: int) -> tuple[float, int]:
    """RSS of a process and its descendants, in MB, and how many processes that is."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20, len(procs)


def test_200_concurrent_turns_all_settle(rig) -> None:
    key = rig.script(
        Round(
            text="Three calls.",
            tool_calls=calls(
                ("echo", {"text": "a"}), ("sleep", {"seconds": 0.1}), ("echo", {"text": "b"})
            ),
        ),
        Round(text="Done."),
    )
    redis = rig.client._store.redis
    t0 = time.monotonic()
    ids = [rig.client._start_turn(f"{key} #{i}").turn_id for i in range(TURNS)]
    queued_s = time.monotonic() - t0
    peak: dict[str, float] = {}
    statuses: list[str | None] = []
    while time.monotonic() - t0 < BOUND_S:
        pipe = redis.pipeline()
        for tid in ids:
            pipe.hget(k.turn_key(tid), "status")
        statuses = [None if s is None else json.loads(s) for s in pipe.execute()]
        for w in rig.workers:
            mb, _ = _rss_mb(w.pid)
            peak[w.name] = max(peak.get(w.name, 0.0), mb)
        if all(s in ("finished", "aborted", "error") for s in statuses):
            break
        time.sleep(0.25)
    elapsed_s = time.monotonic() - t0
    assert statuses.count("finished") == TURNS, {s: statuses.count(s) for s in set(statuses)}

    results = 0
    resumed = 0
    for tid in ids:
        turn = rig.client.get(tid)
        assert_valid_history(turn["history"])
        assert [r["status"] for r in turn["invocations"]] == ["ok"] * 3, tid
        results += len(turn["invocations"])
        resumed += sum(e.type == "turn_resumed" for e in rig.log_events(tid))
    assert results == 3 * TURNS
    assert len(set(ids)) == TURNS

    lines = [
        f"{TURNS} turns x 3 calls: queued in {queued_s:.2f}s, all settled in {elapsed_s:.1f}s "
        f"({TURNS / elapsed_s:.1f} turns/s, {3 * TURNS / elapsed_s:.1f} calls/s); "
        f"lost: 0; resumed after a lapsed lease: {resumed}",
    ]
    for w in rig.workers:
        mb, n = _rss_mb(w.pid)
        own = psutil.Process(w.pid).memory_info().rss / 2**20
        each = (
            f" (main {own:.0f} MB + {n - 1} pool x {(mb - own) / (n - 1):.0f} MB)" if n > 1 else ""
        )
        lines.append(
            f"  {w.name}: {n} processes, RSS {mb:.0f} MB{each}, peak {peak[w.name]:.0f} MB"
        )
    server = psutil.Process(rig.redis.pid).memory_info().rss / 2**20
    lines.append(f"  redis-server: RSS {server:.0f} MB")
    lines.append(
        f"  test process (client + model server): RSS "
        f"{psutil.Process().memory_info().rss / 2**20:.0f} MB"
    )
    print("\n" + "\n".join(lines))
    assert elapsed_s < BOUND_S
