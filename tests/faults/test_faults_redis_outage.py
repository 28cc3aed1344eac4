"""Redis away under load: 30 turns of sync and async calls while Redis restarts.

A tool that finished while Redis was away, or whose result was on its way, still reaches
its turn: its result waits in the worker and is written when Redis answers again, before
the turn's lost-deadline. So, for each fault (a restart and a kill -9 of a Redis with an
append-only file, and a 10 s outage): no call whose tool completed settles `lost`, every
call has exactly one result, and every turn ends.

`AGENTQ_OUTAGE_RUNS` (default 3) runs of each fault in one rig; `scripts/chaos.py
--redis-outages N` loops them longer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.outage import FAULTS, OutageRun, run_outage
from tests.faults.rig import Rig

pytestmark = [pytest.mark.faults, pytest.mark.integration]

RUNS = int(os.environ.get("AGENTQ_OUTAGE_RUNS", "3"))


@pytest.mark.timeout(120 + 60 * RUNS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_no_completed_call_is_lost_when_redis_goes_away(
    make_rig: Callable[..., Rig], tmp_path: Path, fault: str
) -> None:
    rig = make_rig(appendonly=True)
    rig.start("tools", "io", "llm", "turns", concurrency={"tools": 8, "io": 4})
    runs: list[OutageRun] = []
    for n in range(RUNS):
        run = run_outage(rig, fault, tmp_path / f"run{n}")
        runs.append(run)
        print(f"\n{fault} run {n}: {run.summary()}")
        assert run.unended == [], run.summary()
        # Every call has exactly one result, and a tool that completed is never `lost`.
        assert run.duplicates == [], run.duplicates
        assert run.lost_completed == [], (run.lost_completed, rig.logs()[-4000:])
        assert run.statuses == Counter({"ok": run.calls}), run.summary()
        assert run.ran_twice == [], run.ran_twice
    # The fault struck while calls ran (and some ended while Redis was away).
    assert any(r.running_at_fault for r in runs)
