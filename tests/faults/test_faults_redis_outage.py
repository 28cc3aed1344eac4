"""Redis away under load: 30 turns of sync and async calls while Redis restarts.

A tool that finished while Redis was away, or whose result was on its way, still reaches
its turn: its result waits in the worker and is written when Redis answers again, before
the turn's lost-deadline. So, for each fault (a restart and a kill -9 of a Redis with an
append-only file, and a 10 s outage): no call whose tool completed settles `lost`, every
call has exactly one result, and every turn ends, `finished`. A 20 s outage, past
redis-py's own retries, holds the writes in the workers (the results of calls and of
model rounds) and must lose nothing either.

`AGENTQ_OUTAGE_RUNS` (default 3) runs of each fault in one rig; `scripts/chaos.py
--redis-outages N` loops them longer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.outage import FAULTS, LONG_OUTAGE, OutageRun, run_outage
from tests.faults.rig import Rig

pytestmark = [pytest.mark.faults, pytest.mark.integration]

RUNS = int(os.environ.get("AGENTQ_OUTAGE_RUNS", "3"))


@pytest.fixture(scope="module")
def outage_rig() -> Iterator[Rig]:
    """One rig for every fault: each run leaves Redis up again and every turn ended (the
    runs of a fault already share it)."""
    rig = Rig("redis_outage", appendonly=True)
    try:
        rig.start("tools", "io", "llm", "turns", concurrency={"tools": 8, "io": 4})
        yield rig
    finally:
        rig.close()


def _check(rig: Rig, run: OutageRun) -> None:
    assert run.unended == [], run.summary()
    assert run.not_finished == [], run.summary()
    # Every call has exactly one result, and a tool that completed is never `lost`.
    assert run.duplicates == [], run.duplicates
    assert run.lost_completed == [], (run.lost_completed, rig.logs()[-4000:])
    assert run.statuses == Counter({"ok": run.calls}), run.summary()
    assert run.ran_twice == [], run.ran_twice


@pytest.mark.timeout(120 + 60 * RUNS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_no_completed_call_is_lost_when_redis_goes_away(
    outage_rig: Rig, tmp_path: Path, fault: str
) -> None:
    rig = outage_rig
    runs: list[OutageRun] = []
    for n in range(RUNS):
        run = run_outage(rig, fault, tmp_path / f"run{n}")
        runs.append(run)
        print(f"\n{fault} run {n}: {run.summary()}")
        _check(rig, run)
    # The fault struck while calls ran (and some ended while Redis was away).
    assert any(r.running_at_fault for r in runs)


@pytest.mark.timeout(150)
def test_nothing_is_lost_in_an_outage_past_redis_pys_retries(
    outage_rig: Rig, tmp_path: Path
) -> None:
    rig = outage_rig
    run = run_outage(rig, LONG_OUTAGE, tmp_path)
    print(f"\n{LONG_OUTAGE}: {run.summary()}")
    _check(rig, run)
    assert run.running_at_fault
