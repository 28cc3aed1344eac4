#!/usr/bin/env python3
"""Chaos soak: a mixed load of turns while workers die, roll and Redis fails over.

Starts Redis behind Sentinel (master, replica, three sentinels), the scripted model and
a fleet of workers of every kind, all on loopback and stopped by PID at the end. While
drivers keep turns running through the public API (`agentq.Client`: parallel calls,
timeouts, approvals answered and left to time out, aborts, sub-agents, async tools on
the I/O worker, sync tools on prefork), an injector SIGKILLs random workers and tool
processes, rolls workers (SIGTERM, then a new one), restarts Redis servers and fails
the master over through Sentinel. At the end it checks, from Redis, the event logs and
the tools' own run records:

- every turn ended (none hung);
- every call of every turn has exactly one result;
- no call of a non-idempotent tool ran twice;
- every event log has `seq` without gaps;
- no interaction is left open.

    python3 scripts/chaos.py                      # about 9 minutes
    python3 scripts/chaos.py --duration-s 90 --seed 7
    python3 scripts/chaos.py --redis-outages 20   # Redis away under 30 turns, looped
    python3 scripts/chaos.py --redis-outages 999 --outages-for-s 3600 --long-outages

`--redis-outages N` runs the fault suite's Redis outage (tests/faults/outage.py) N times
for each fault, the faults in turn in one rig (a restart and a kill -9 of a Redis with
AOF, a 10 s outage, and with `--long-outages` a 20 s one, past redis-py's own retries;
AGENTQ_OUTAGE_S changes the 10 s), stopping at the first run that loses a call, leaves
a turn not finished, or when `--outages-for-s` is up: 30 to 60 s a run on a busy 2-core
machine, so 20 runs of each take 30 to 60 minutes.

Prints a table of faults and invariants; exits 1 on a violation, naming the seed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentq.api import Client  # noqa: E402
from agentq.constants import turn_key  # noqa: E402
from agentq.events import TERMINAL_TYPES, Event  # noqa: E402
from agentq.fleet import runtime  # noqa: E402
from agentq.local.fleet import LocalFleet  # noqa: E402
from agentq.local.processes import ManagedProcess  # noqa: E402
from agentq.local.redis_server import RedisServer  # noqa: E402
from agentq.testing.openai_server import Round, ScriptedCall, ScriptedOpenAIServer  # noqa: E402
from tests.rigs.chaos_tools import RUNS_FILE  # noqa: E402
from tests.rigs.sentinel import SentinelCluster  # noqa: E402
from tests.rigs.workers import worker_env  # noqa: E402

TOOLS = "agentq.testing.tools,tests.rigs.chaos_tools"
FLEET = {"tools": 2, "io": 1, "llm": 1, "turns": 2}
CONCURRENCY: dict[str, int | None] = {"tools": 3, "io": None, "llm": 8, "turns": 16}
FAULT_WEIGHTS = {
    "sigkill worker": 30,
    "sigkill tool process": 12,
    "rolling restart": 25,
    "redis restart": 10,
    "sentinel failover": 13,
}
ENDED = ("finished", "aborted", "error")
TURN_WAIT_S = 150.0
ROLL_GRACE_S = 40.0
"""A rolled worker gets this long for its warm shutdown before it is killed."""


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Churn:
    """The soak's workers on a LocalFleet, replaced in background threads so faults overlap."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.local = LocalFleet(env, log_dir=logs, name="chaos", stop_timeout_s=10)
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        self._threads: list[threading.Thread] = []

    def start(self, kind: str) -> ManagedProcess:
        return self.local.start_worker(kind, concurrency=CONCURRENCY[kind], ready_timeout_s=120)

    def start_all(self) -> None:
        kinds = [k for k, n in FLEET.items() for _ in range(n)]
        with ThreadPoolExecutor(len(kinds)) as pool:
            list(pool.map(self.start, kinds))

    def live(self, kind: str) -> list[ManagedProcess]:
        return self.local.live(kind)

    def pick(self, rng: random.Random) -> tuple[str, ManagedProcess] | None:
        """A live worker of a kind not being replaced right now."""
        with self._lock:
            kinds = [k for k in FLEET if k not in self._busy and self.local.workers(k)]
            if not kinds:
                return None
            kind = rng.choice(kinds)
            self._busy.add(kind)
            return kind, rng.choice(self.local.workers(kind))

    def replace(self, kind: str, proc: ManagedProcess, how: Callable[[], object]) -> None:
        """Stop `proc` with `how`, then start a new worker of its kind (in the background)."""

        def run() -> None:
            try:
                how()
                self.local.retire(proc)
                self.start(kind)
            except Exception as exc:
                say(f"replacing a {kind} worker failed: {exc}")
            finally:
                with self._lock:
                    self._busy.discard(kind)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads.append(t)

    def settle(self) -> None:
        """Wait for every replacement, then make sure the whole fleet runs."""
        for t in self._threads:
            t.join(ROLL_GRACE_S + 150)
        for kind, n in FLEET.items():
            while len(self.live(kind)) < n:
                self.start(kind)

    def stop(self) -> None:
        self.local.stop()


def roll(proc: ManagedProcess) -> None:
    """SIGTERM the worker's main process only (a deploy's signal), wait, kill past grace."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(ROLL_GRACE_S)
    except (ProcessLookupError, Exception):
        pass
    proc.kill()


@dataclass
class Tally:
    faults: Counter[str] = field(default_factory=Counter)
    scenarios: Counter[str] = field(default_factory=Counter)
    turns: list[str] = field(default_factory=list)
    driver_hung: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1


class Injector(threading.Thread):
    def __init__(
        self,
        fleet: Churn,
        cluster: SentinelCluster,
        rng: random.Random,
        tally: Tally,
        interval_s: float,
        stop_at: float,
    ) -> None:
        super().__init__(daemon=True, name="chaos-injector")
        self.fleet, self.cluster, self.rng, self.tally = fleet, cluster, rng, tally
        self.interval_s = interval_s
        self.stop_at = stop_at
        # At least three failovers in any run: one is forced when none came for a while.
        self.failover_every_s = (stop_at - time.monotonic()) / 3.5
        self.last_failover = time.monotonic()

    def run(self) -> None:
        while time.monotonic() < self.stop_at:
            time.sleep(self.rng.uniform(0.5, 1.5) * self.interval_s)
            kinds, weights = zip(*FAULT_WEIGHTS.items(), strict=True)
            fault = self.rng.choices(kinds, weights)[0]
            if time.monotonic() - self.last_failover > self.failover_every_s:
                fault = "sentinel failover"
            if fault == "sentinel failover":
                self.last_failover = time.monotonic()
            try:
                if self.inject(fault):
                    self.tally.fault(fault)
            except Exception as exc:
                say(f"{fault} failed: {type(exc).__name__}: {exc}")

    def inject(self, fault: str) -> bool:
        if fault in ("sigkill worker", "rolling restart"):
            picked = self.fleet.pick(self.rng)
            if picked is None:
                return False
            kind, proc = picked
            how = proc.kill if fault == "sigkill worker" else (lambda: roll(proc))
            say(f"{fault}: {kind} pid {proc.pid}")
            self.fleet.replace(kind, proc, how)
            return True
        if fault == "sigkill tool process":
            live = self.fleet.live("tools")
            children = [c for w in live for c in w.children_pids()]
            if not children:
                return False
            pid = self.rng.choice(children)
            say(f"{fault}: pid {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return False
            return True
        if fault == "redis restart":
            server = self.rng.choice(self.cluster.servers)
            self._restart(server)
            return True
        if fault == "sentinel failover":
            t0 = time.monotonic()
            port = self.cluster.failover()
            say(f"{fault}: master now on port {port} ({time.monotonic() - t0:.1f} s)")
            return True
        raise ValueError(fault)

    def _restart(self, server: RedisServer) -> None:
        master = self.cluster.master_port()
        role = "master" if server.port == master else "replica"
        # Comes back in the role it has now, as Sentinel last configured it.
        server.extra_args = [] if role == "master" else ["--replicaof", "127.0.0.1", str(master)]
        t0 = time.monotonic()
        server.restart()
        say(f"redis restart: {role} on port {server.port} ({time.monotonic() - t0:.1f} s)")


class Driver(threading.Thread):
    """Runs one turn after another through the public API until told to stop."""

    SCENARIOS = ("parallel", "rounds", "timeout", "approve", "approval_timeout", "abort", "sub")

    def __init__(
        self, n: int, llm: ScriptedOpenAIServer, rng: random.Random, tally: Tally, stop_at: float
    ) -> None:
        super().__init__(daemon=True, name=f"chaos-driver-{n}")
        self.llm, self.tally, self.stop_at = llm, tally, stop_at
        self.rng = random.Random(rng.random())
        self.client = Client()

    def script(self, *rounds: Round) -> str:
        key = f"c-{uuid.uuid4().hex[:12]}"
        self.llm.set_script(key, list(rounds))
        return key

    def run(self) -> None:
        while time.monotonic() < self.stop_at:
            scenario = self.rng.choice(self.SCENARIOS)
            try:
                self.turn(scenario)
            except Exception as exc:
                say(f"driver: {scenario} turn: {type(exc).__name__}: {exc}")
                time.sleep(1.0)

    def turn(self, scenario: str) -> None:
        r = self.rng
        done = Round(text=f"{scenario} done")
        calls: list[ScriptedCall]
        rounds: list[Round]
        if scenario == "parallel":
            calls = [
                ScriptedCall(name="chaos_work", arguments={"seconds": r.uniform(0.2, 2.0)}),
                ScriptedCall(name="chaos_async", arguments={"seconds": r.uniform(0.2, 2.0)}),
                ScriptedCall(name="chaos_idempotent", arguments={"seconds": r.uniform(0.2, 1)}),
                ScriptedCall(name="chaos_async", arguments={"seconds": r.uniform(0.2, 1.0)}),
            ]
            rounds = [Round(tool_calls=calls), done]
        elif scenario == "rounds":
            rounds = [
                Round(tool_calls=[ScriptedCall(name="chaos_work", arguments={"seconds": 0.5})]),
                Round(tool_calls=[ScriptedCall(name="chaos_async", arguments={"seconds": 0.5})]),
                Round(tool_calls=[ScriptedCall(name="echo", arguments={"text": "x"})]),
                done,
            ]
        elif scenario == "timeout":
            rounds = [Round(tool_calls=[ScriptedCall(name="chaos_overrun")]), done]
        elif scenario in ("approve", "approval_timeout"):
            rounds = [Round(tool_calls=[ScriptedCall(name="chaos_ask")]), done]
        elif scenario == "abort":
            calls = [
                ScriptedCall(name="chaos_work", arguments={"seconds": 8}),
                ScriptedCall(name="chaos_async", arguments={"seconds": 8}),
            ]
            rounds = [Round(tool_calls=calls), done]
        else:
            child = self.script(
                Round(tool_calls=[ScriptedCall(name="chaos_work", arguments={"seconds": 0.3})]),
                Round(text="child done"),
            )
            sub = ScriptedCall(name="chaos_subagent", arguments={"prompt": child})
            rounds = [Round(tool_calls=[sub]), done]
        handle = self.client._start_turn(self.script(*rounds))
        with self.tally.lock:
            self.tally.turns.append(handle.turn_id)
            self.tally.scenarios[scenario] += 1
        abort_at = time.monotonic() + r.uniform(0.5, 4.0) if scenario == "abort" else None
        deadline = time.monotonic() + TURN_WAIT_S
        for ev in self.client.events(handle.turn_id, heartbeat_s=0.5):
            if ev is not None:
                if ev.type in TERMINAL_TYPES:
                    return
                if ev.type == "interaction_requested" and scenario == "approve":
                    self._answer(handle.turn_id, handle.token, ev)
            if abort_at is not None and time.monotonic() >= abort_at:
                abort_at = None
                with contextlib.suppress(Exception):  # it may have finished first
                    self.client.abort(handle.turn_id, handle.token)
            if time.monotonic() > deadline:
                with self.tally.lock:
                    self.tally.driver_hung.append(handle.turn_id)
                return

    def _answer(self, turn_id: str, token: str, ev: Event) -> None:
        with contextlib.suppress(Exception):  # it may have timed out first
            self.client.answer(turn_id, str(ev.fields["request_id"]), token, "approve")


# --------------------------------------------------------------------------- invariants


@dataclass
class Check:
    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)


def all_turns(client: Client, roots: list[str]) -> list[str]:
    """The turns the drivers started and every sub-agent turn under them."""
    seen: list[str] = []
    todo = list(roots)
    while todo:
        tid = todo.pop()
        if tid in seen:
            continue
        seen.append(tid)
        todo.extend(client._store.children(tid))
    return seen


def check_invariants(client: Client, turns: list[str], runs_file: Path) -> list[Check]:
    store = client._store
    ended, one_result, once, gapless, closed = (
        Check("every turn ended"),
        Check("every call has exactly one result"),
        Check("no non-idempotent call ran twice"),
        Check("event log seq without gaps"),
        Check("no interaction left open"),
    )
    for tid in turns:
        log = store.bus.replay(tid, "0-0", count=1_000_000)
        status = store.status(tid)
        ended.checked += 1
        if status not in ENDED or not log or log[-1].type not in TERMINAL_TYPES:
            last = log[-1].type if log else None
            ended.violations.append(f"{tid}: status {status}, last event {last}")
        gapless.checked += 1
        seqs = [e.seq for e in log]
        if seqs != list(range(1, len(seqs) + 1)):
            gapless.violations.append(f"{tid}: seq {seqs[:5]}...{seqs[-5:]}")
        finished = Counter(str(e.fields.get("call_id")) for e in log if e.type == "tool_finished")
        history = store.history(tid)
        for i, msg in enumerate(history):
            for call in msg.get("tool_calls") or []:
                one_result.checked += 1
                answers = [m for m in history[i + 1 :] if m.get("tool_call_id") == call["id"]]
                if len(answers) != 1 or finished[call["id"]] > 1:
                    one_result.violations.append(
                        f"{tid}/{call['id']}: {len(answers)} tool messages, "
                        f"{finished[call['id']]} tool_finished"
                    )
        for e in log:
            if e.type == "interaction_requested":
                closed.checked += 1
                state = store.redis.hget(
                    turn_key(tid, "interaction", str(e.fields["request_id"])), "state"
                )
                if state in (b"pending", "pending"):
                    closed.violations.append(f"{tid}: interaction {e.fields['request_id']} open")
    runs: Counter[str] = Counter()
    if runs_file.exists():
        for line in runs_file.read_text().splitlines():
            tag, call, _pid = line.split()
            if tag == "once":
                runs[call] += 1
    once.checked = len(runs)
    once.violations = [f"{call} ran {n} times" for call, n in runs.items() if n > 1]
    return [ended, one_result, once, gapless, closed]


def report(seed: int, duration_s: float, tally: Tally, checks: list[Check], turns: int) -> bool:
    print()
    print(f"chaos soak: seed {seed}, {duration_s:.0f} s of faults, {turns} turns")
    print()
    print("| fault | injected |")
    print("|---|---:|")
    for kind in FAULT_WEIGHTS:
        print(f"| {kind} | {tally.faults[kind]} |")
    print(f"| **total** | **{sum(tally.faults.values())}** |")
    print()
    print("| turns by scenario | started |")
    print("|---|---:|")
    for name, n in sorted(tally.scenarios.items()):
        print(f"| {name} | {n} |")
    print()
    print("| invariant | checked | violations | held |")
    print("|---|---:|---:|---|")
    ok = True
    for c in checks:
        held = not c.violations
        ok &= held
        print(f"| {c.name} | {c.checked} | {len(c.violations)} | {'yes' if held else 'NO'} |")
    for c in checks:
        for v in c.violations[:10]:
            print(f"  {c.name}: {v}")
    if not ok:
        print(f"\nVIOLATED: replay with --seed {seed}")
    return ok


@dataclass
class FaultRow:
    """What one fault's runs in the outage loop came to."""

    runs: int = 0
    failed: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    running: list[int] = field(default_factory=list)
    completed_in_outage: int = 0
    ended_s: list[float] = field(default_factory=list)

    def line(self, fault: str) -> str:
        st, run_at, ends = self.statuses, self.running or [0], self.ended_s or [0.0]
        return (
            f"| {fault} | {self.runs} | {sum(st.values()):,} | {st['ok']:,} | {st['lost']} | "
            f"{self.failed} | {min(run_at)}-{max(run_at)} | {self.completed_in_outage} | "
            f"{min(ends):.1f}-{max(ends):.1f} s |"
        )


def redis_outages(runs: int, duration_s: float | None, long_outage: bool) -> int:
    """The Redis outage loop: the faults in turn in one rig, `runs` runs of each (or until
    `duration_s` is up), stopping at the first run that loses a call; a table at the end."""
    from tests.faults.outage import FAULTS, LONG_OUTAGE, run_outage
    from tests.faults.rig import Rig

    faults = [*FAULTS, *([LONG_OUTAGE] if long_outage else [])]
    rows = {fault: FaultRow() for fault in faults}
    ok = True
    t0 = time.monotonic()
    rig = Rig("outage", appendonly=True)
    try:
        rig.start("tools", "io", "llm", "turns", concurrency={"tools": 8, "io": 4})
        with tempfile.TemporaryDirectory(prefix="agentq-outage-") as work:
            n = 0
            while ok and n < runs and (duration_s is None or since(t0) < duration_s):
                for fault in faults:
                    run = run_outage(rig, fault, Path(work) / f"run{n}-{faults.index(fault)}")
                    say(f"{fault} run {n}: {run.summary()}")
                    row = rows[fault]
                    row.runs += 1
                    row.statuses += run.statuses
                    row.running.append(run.running_at_fault)
                    row.completed_in_outage += run.completed_in_outage
                    row.ended_s.append(run.ended_s)
                    wrong = (
                        run.unended
                        or run.not_finished
                        or run.duplicates
                        or run.lost_completed
                        or run.ran_twice
                    )
                    if wrong or set(run.statuses) != {"ok"}:
                        row.failed += 1
                        ok = False
                        break
                n += 1
    finally:
        rig.close()
    print(f"\n{since(t0) / 60:.0f} min")
    print(
        "| fault | runs | calls | ok | lost | failed runs | running at the fault "
        "| completed while Redis was away | turns ended after the fault |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for fault, row in rows.items():
        print(row.line(fault))
    return 0 if ok else 1


def since(t0: float) -> float:
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=540.0, help="how long faults go on")
    ap.add_argument("--seed", type=int, default=None, help="replays a run (default: random)")
    ap.add_argument("--drivers", type=int, default=6, help="turns running at once")
    ap.add_argument("--fault-interval-s", type=float, default=2.0, help="mean time between faults")
    ap.add_argument("--drain-s", type=float, default=180.0, help="time for turns to end after")
    ap.add_argument("--logs", type=Path, default=ROOT / "artifacts" / "chaos")
    ap.add_argument(
        "--redis-outages", type=int, default=0, help="only the Redis outage loop, N runs a fault"
    )
    ap.add_argument(
        "--outages-for-s",
        type=float,
        default=None,
        help="the outage loop stops after this long (at the end of a round of the faults)",
    )
    ap.add_argument(
        "--long-outages", action="store_true", help="the outage loop adds a 20 s outage"
    )
    args = ap.parse_args(argv)
    if args.redis_outages:
        return redis_outages(args.redis_outages, args.outages_for_s, args.long_outages)
    started = time.monotonic()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    say(f"seed {seed}; logs in {args.logs}")
    args.logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="agentq-chaos-"))
    runs_file = work / RUNS_FILE

    cluster = SentinelCluster(appendonly=True)
    llm = ScriptedOpenAIServer()
    fleet: Churn | None = None
    try:
        cluster.start()
        llm.start()
        env = worker_env(
            cluster.url,
            llm.url,
            tools=TOOLS,
            pythonpath=str(ROOT),
            AGENTQ_REDIS_SENTINEL_MASTER=cluster.master_name,
            AGENTQ_CHAOS_DIR=str(work),
            AGENTQ_APPROVAL_TIMEOUT_S="2",
            AGENTQ_TOOL_QUEUE_TIMEOUT_S="60",
            AGENTQ_VISIBILITY_TIMEOUT_S="30",
        )
        os.environ.update(env)
        runtime.reset()
        fleet = Churn(env, args.logs)
        say("starting the fleet")
        fleet.start_all()
        tally = Tally()
        stop_at = time.monotonic() + args.duration_s
        drivers = [Driver(i, llm, rng, tally, stop_at) for i in range(args.drivers)]
        injector = Injector(fleet, cluster, rng, tally, args.fault_interval_s, stop_at)
        for d in drivers:
            d.start()
        injector.start()
        injector.join()
        say("faults over; restoring the fleet and letting the turns end")
        fleet.settle()
        deadline = time.monotonic() + args.drain_s
        for d in drivers:
            d.join(max(0.0, deadline - time.monotonic()))
        client = Client()
        turns = all_turns(client, list(tally.turns))
        while time.monotonic() < deadline:
            if all(client._store.status(t) in ENDED for t in turns):
                break
            time.sleep(1.0)
        drained_s = time.monotonic() - (deadline - args.drain_s)
        checks = check_invariants(client, turns, runs_file)
        ok = report(seed, args.duration_s, tally, checks, len(turns))
        print(
            f"\ndrained {drained_s:.0f} s after the faults stopped; "
            f"{time.monotonic() - started:.0f} s in all"
        )
        return 0 if ok else 1
    finally:
        if fleet is not None:
            fleet.stop()
        llm.stop()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
