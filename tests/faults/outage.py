"""One run of the Redis-outage fault: 30 turns of a sync and an async call each, Redis taken
away while the calls run, then what every call and turn became.

Shared by tests/faults/test_faults_redis_outage.py and `scripts/chaos.py --redis-outages`.
Each tool counts its start in a file and its end in `<file>.done`: the files outlive the
outage, so a run knows which tools completed whatever Redis says.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agentq.local.processes import wait_for
from agentq.models import TERMINAL_STATUSES
from agentq.testing.openai_server import Round
from tests.helpers import calls, starts

if TYPE_CHECKING:
    from tests.faults.rig import Rig

TURNS = 30
OUTAGE_S = float(os.environ.get("AGENTQ_OUTAGE_S", "10"))
"""The outage of the loop: twice the workers' heartbeat lifetime."""
LONG_OUTAGE_S = 20.0
"""Past redis-py's own retries (about 17 s): results, starts and model rounds wait in
their workers' held writes (agentq.state.held)."""
END_BOUND_S = 90.0


def _restart(rig: Rig) -> None:
    rig.redis.restart()


def _kill9(rig: Rig) -> None:
    rig.redis.kill()
    rig.redis.start()


def _outage_of(seconds: float) -> Callable[[Rig], None]:
    def outage(rig: Rig) -> None:
        rig.redis.halt()
        # The fault is the time Redis stays away: nothing to wait for but the clock.
        time.sleep(seconds)
        rig.redis.start()

    return outage


FAULTS: dict[str, Callable[[Rig], None]] = {
    "restart with AOF": _restart,
    "kill -9 with AOF": _kill9,
    f"{OUTAGE_S:g} s outage": _outage_of(OUTAGE_S),
}
LONG_OUTAGE = f"{LONG_OUTAGE_S:g} s outage"
ALL_FAULTS: dict[str, Callable[[Rig], None]] = {
    **FAULTS,
    LONG_OUTAGE: _outage_of(LONG_OUTAGE_S),
}


@dataclass
class OutageRun:
    calls: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    running_at_fault: int = 0
    completed_in_outage: int = 0
    unended: list[str] = field(default_factory=list)
    duplicates: list[tuple[str, int]] = field(default_factory=list)
    """(call id, tool_finished events) where a call had other than one."""
    lost_completed: list[tuple[str, str, str]] = field(default_factory=list)
    """(turn, tool, error) of calls settled `lost` whose tool had completed."""
    ran_twice: list[str] = field(default_factory=list)
    turns: Counter[str] = field(default_factory=Counter)
    """How the turns ended: their statuses."""
    not_finished: list[tuple[str, str, str]] = field(default_factory=list)
    """(turn, status, error) of every turn that ended other than `finished`."""
    lost: list[tuple[str, str, str, int, int]] = field(default_factory=list)
    """(turn, tool, error, starts, ends) of every call settled `lost`."""
    ended_s: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.calls} calls {dict(self.statuses)}; {self.running_at_fault} running at the "
            f"fault, {self.completed_in_outage} completed while Redis was away; turns ended "
            f"{self.ended_s:.1f} s after it: {dict(self.turns)}; not ended {len(self.unended)}, "
            f"lost though completed {len(self.lost_completed)}; lost: {self.lost}; "
            f"not finished: {self.not_finished}"
        )


def _done(path: Path) -> int:
    return starts(path.with_name(path.name + ".done"))


def run_outage(rig: Rig, fault: str, where: Path) -> OutageRun:
    """Start TURNS turns, strike `fault` once calls run, and report what they became."""
    where.mkdir(parents=True, exist_ok=True)
    if fault == "kill -9 with AOF":
        # Under `appendfsync everysec` a kill -9 may lose the last second of acknowledged
        # writes (a start record, so a tool may run twice: docs/reliability.md). The
        # fault checked here is the worker's side of it: the setting that keeps every
        # acknowledged write, set again after each start (CONFIG SET does not outlive one).
        conn = rig.redis.client()
        conn.config_set("appendfsync", "always")
        conn.close()
    paths: dict[str, tuple[Path, Path]] = {}
    for i in range(TURNS):
        sync, aio = where / f"s{i}", where / f"a{i}"
        # Spread over 0.5-3 s: some end before the fault, some while Redis is away.
        seconds = 0.5 + (i % 6) * 0.5
        key = rig.script(
            Round(
                tool_calls=calls(
                    ("counted_through", {"path": str(sync), "seconds": seconds}),
                    ("counted_async", {"path": str(aio), "seconds": seconds}),
                )
            ),
            Round(text="Both calls came back."),
        )
        paths[rig.client._start_turn(key).turn_id] = (sync, aio)
    every = [p for pair in paths.values() for p in pair]
    wait_for(lambda: sum(starts(p) for p in every) >= TURNS // 2, 60, message="calls to start")
    run = OutageRun()
    run.running_at_fault = sum(starts(p) - _done(p) for p in every)
    done_before = sum(_done(p) for p in every)
    t0 = time.monotonic()
    ALL_FAULTS[fault](rig)
    run.completed_in_outage = sum(_done(p) for p in every) - done_before

    def ended(tid: str) -> bool:
        return rig.client.get(tid)["state"].get("status") in TERMINAL_STATUSES

    try:
        wait_for(lambda: all(ended(t) for t in paths), END_BOUND_S, interval_s=0.25)
    except Exception:
        run.unended = [t for t in paths if not ended(t)]
    run.ended_s = time.monotonic() - t0
    for tid, (sync, aio) in paths.items():
        turn = rig.client.get(tid)
        state = turn["state"]
        run.turns[str(state.get("status"))] += 1
        if state.get("status") != "finished":
            run.not_finished.append((tid, str(state.get("status")), str(state.get("error"))))
        ends = [e.fields for e in rig.log_events(tid) if e.type == "tool_finished"]
        finished = Counter(str(f.get("call_id")) for f in ends)
        errors = {str(f.get("call_id")): str(f.get("error")) for f in ends}
        run.duplicates += [(c, n) for c, n in finished.items() if n != 1]
        by_tool = {"counted_through": sync, "counted_async": aio}
        for rec in turn["invocations"]:
            run.calls += 1
            run.statuses[rec["status"]] += 1
            path = by_tool[rec["tool"]]
            if rec["status"] == "lost":
                why = errors.get(rec["call_id"], "")
                run.lost.append((tid, rec["tool"], why, starts(path), _done(path)))
            if rec["status"] == "lost" and _done(path):
                run.lost_completed.append((tid, rec["tool"], errors.get(rec["call_id"], "")))
        run.ran_twice += [str(p) for p in (sync, aio) if starts(p) > 1]
        if len(turn["invocations"]) != 2:
            run.duplicates.append((tid, len(turn["invocations"])))
    return run
