"""The capacity stages of the benchmark: turns held while they wait (`held`), and
I/O-bound turns by the thousand on the I/O and stream workers (`io`)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from agentq.fleet import runtime
from agentq.local.processes import start_worker
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_stages import BenchRig, Sizes, pct, turn_statuses

ABORT_CLIENTS = 16
"""Client threads that press Cancel on the held turns, as many users would at once."""


def pids_by_kind(fx: BenchRig, pids: dict[int, str]) -> dict[int, str]:
    """`pids` and every process of the fleet with its kind (a pool's children counted with
    their worker)."""
    out = dict(pids)
    for kind, proc in fx.procs.items():
        out[proc.pid] = kind
        for child in proc.children_pids():
            out[child] = kind
    return out


def redis_clients_by_kind(fx: BenchRig, extra: dict[int, str] | None = None) -> dict[str, int]:
    """Open connections to the bench's Redis, by process kind."""
    port = int(runtime.get_store().redis.connection_pool.connection_kwargs.get("port", 6379))
    out: Counter[str] = Counter()
    for pid, kind in pids_by_kind(fx, {os.getpid(): "bench client", **(extra or {})}).items():
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == port:
                    out[kind] += 1
    return dict(out)


def bench_held(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """N turns each wait on one slow call while the tool worker has 2 processes: how many
    one default turn worker holds at once, at what cost, and how fast they all abort."""
    from agentq import constants as k
    from agentq.api import Client

    client = Client()
    store = runtime.get_store()
    n = sz.held_turns
    tools = start_worker(
        "tools",
        env=fx.env,
        hostname=f"bench-held-{fx.run_id}@%h",
        concurrency=2,
        extra_args=("-Q", "agentq.held"),
    )
    # The held fleet: what a turn waits on. The baseline Celery worker and the 8-process
    # tool worker of the other stages hold connections of their own, counted apart.
    held_kinds = ("turns", "llm", "held tools", "redis")
    extra = {tools.pid: "held tools", **{c: "held tools" for c in tools.children_pids()}}

    def held_clients() -> tuple[int, dict[str, int]]:
        by_kind = redis_clients_by_kind(fx, extra)
        return sum(v for kind_, v in by_kind.items() if kind_ in held_kinds), by_kind

    try:
        key = fx.script(Round(tool_calls=[ScriptedCall(name="held", arguments={"seconds": 600})]))
        before = fx.memory_mb().get("turns", 0.0)
        clients_before = int(store.redis.info("clients")["connected_clients"])
        fleet_before, _ = held_clients()
        t0 = time.perf_counter()
        handles = [client._start_turn(f"{key} #{i}") for i in range(n)]
        peak_clients = clients_before
        peak_fleet, peak_by_kind = fleet_before, {}
        held = 0
        deadline = time.perf_counter() + 60 + n * 0.1
        while time.perf_counter() < deadline:
            peak_clients = max(peak_clients, int(store.redis.info("clients")["connected_clients"]))
            fleet_now, by_kind = held_clients()
            if fleet_now >= peak_fleet:
                peak_fleet, peak_by_kind = fleet_now, by_kind
            pipe = store.redis.pipeline(transaction=False)
            for h in handles:
                # Its round's calls are planned (the first record of its calls).
                pipe.hget(k.turn_key(h.turn_id), "round_calls")
            held = sum(1 for x in pipe.execute() if x not in (None, b"null"))
            if held == n:
                break
            time.sleep(0.5)
        held_s = time.perf_counter() - t0
        turns_mb = fx.memory_mb().get("turns", 0.0) - before
        t1 = time.perf_counter()
        with ThreadPoolExecutor(ABORT_CLIENTS) as pool:
            list(pool.map(lambda h: client.abort(h.turn_id, h.token), handles))
        while store.redis.zcard(k.WAKEUPS) and time.perf_counter() - t1 < 120:
            time.sleep(0.05)
        aborted_s = time.perf_counter() - t1
        left = int(store.redis.zcard(k.WAKEUPS))
    finally:
        tools.stop(timeout_s=10)
    return {
        "held_turns": n,
        "held_at_once": held,
        "held_seconds_to_hold": round(held_s, 2),
        "held_redis_clients_before": clients_before,
        "held_redis_clients_all_peak": peak_clients,
        "held_redis_clients_peak": peak_fleet,
        "held_redis_clients_by_kind": peak_by_kind,
        "held_turn_worker_kb_per_turn": round(turns_mb * 1024 / max(n, 1), 1),
        "held_abort_all_seconds": round(aborted_s, 2),
        "held_not_ended": left,
        "notes": [
            f"held: Redis connections of the held fleet ({', '.join(held_kinds)}) at their "
            f"peak: {peak_by_kind}; all clients of the bench's Redis {clients_before} before, "
            f"{peak_clients} at the peak; aborts from {ABORT_CLIENTS} client threads"
        ],
    }


# --------------------------------------------------------------------------- the io stage

IO_WAIT_S = 5.0
IO_STREAM_S = 2.0


def _stream_round(tool_calls: list[ScriptedCall] | None = None) -> Round:
    """A round that streams for IO_STREAM_S: 80 characters (and the tool call's arguments)
    in 4-character chunks, evenly paced."""
    rnd = Round(text="x" * 80, chunk_size=4, tool_calls=tool_calls or [])
    # 21 chunks without the call, 26 with it: one pace for both would stretch round 1.
    rnd.chunk_delay_ms = round(IO_STREAM_S * 1000 / (rnd.chunk_count() - 1))
    return rnd


def _fleet_mb(fx: BenchRig, kinds: tuple[str, ...]) -> float:
    mem = fx.memory_mb()
    return round(sum(mem.get(k_, 0.0) for k_ in kinds), 1)


def cpu_s_by_kind(fx: BenchRig) -> dict[str, float]:
    """CPU seconds used so far by each process kind (pool children included); "bench" is
    this process, which also serves the scripted model."""
    pids: dict[int, str] = {os.getpid(): "bench"}
    if fx.redis is not None:
        pids[fx.redis.pid] = "redis"
    out: Counter[str] = Counter()
    for pid, kind in pids_by_kind(fx, pids).items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[kind] += t.user + t.system
    return dict(out)


def bench_turns_with(
    fx: BenchRig,
    n: int,
    tool: str,
    prefix: str,
    *,
    key: str | None = None,
    floor_s: float = IO_WAIT_S + 2 * IO_STREAM_S,
) -> dict[str, Any]:
    """n real turns at once: round 1 -> one `tool` call of IO_WAIT_S -> round 2 (or the
    script `key`, whose turns call `tool` and last at least `floor_s`)."""
    from agentq import constants as k
    from agentq.api import Client

    client = Client()
    store = runtime.get_store()
    if key is None:
        key = fx.script(
            _stream_round([ScriptedCall(name=tool, arguments={"seconds": IO_WAIT_S})]),
            _stream_round(),
        )
    # This process is also the model server: the requests of earlier stages, which it
    # records for tests and the bench never reads, would weigh on its collector here.
    if fx.llm is not None:
        fx.llm.reset()
    gc.collect()
    # The fleet the turns run on; the other stages' workers idle beside it, counted apart.
    kinds = ("turns", "llm", "redis", "io" if tool.startswith("aio") else "tools")
    everything = (*fx.procs, "redis")
    before = _fleet_mb(fx, kinds)
    peak_all = _fleet_mb(fx, everything)
    peak = before
    cpu_before = cpu_s_by_kind(fx)
    commands_before = redis_commands(store.redis)
    since = time.time()
    t0 = time.perf_counter()
    ids = [client._start_turn(f"{key} #{i}").turn_id for i in range(n)]
    # The watcher shares the fleet's two cores: it counts this stage's turns still open
    # (the open turns: one ZCARD), and the memory of every process
    # (psutil walks /proc) once a second. Reading a thousand statuses five times a second
    # cost the fleet two CPU-seconds of the stage.
    next_mem = 0.0
    while time.perf_counter() - t0 < 300:
        if time.perf_counter() >= next_mem:
            next_mem = time.perf_counter() + 1.0
            peak = max(peak, _fleet_mb(fx, kinds))
            peak_all = max(peak_all, _fleet_mb(fx, everything))
        if not store.redis.zcard(k.WAKEUPS):
            break
        time.sleep(0.05)
    took = time.perf_counter() - t0
    # Everything Redis ran meanwhile, the commands scripts ran included (as MONITOR shows
    # them): the turns', the idle workers' and this watcher's (about 20 a second).
    commands = redis_commands(store.redis) - commands_before
    statuses = turn_statuses(store, ids)
    # To the hundredth: a --quick shape's fleet spends about 1 CPU-s, where tenths of each
    # process, summed, moved its ratio by up to a fifth.
    spent = {kind: v - cpu_before.get(kind, 0.0) for kind, v in cpu_s_by_kind(fx).items()}
    cpu = {kind: round(v, 2) for kind, v in spent.items() if v >= 0.005}
    counts = Counter(str(s) for s in statuses)
    phases = _phase_ms(store, ids, since)
    return {
        f"{prefix}_turns": n,
        f"{prefix}_all_settled": counts.get("finished") == n,
        f"{prefix}_seconds": round(took, 2),
        f"{prefix}_statuses": dict(counts),
        f"{prefix}_floor_seconds": floor_s,
        f"{prefix}_peak_rss_mb": peak,
        f"{prefix}_idle_rss_mb": before,
        f"{prefix}_fleet": "+".join(kinds),
        f"{prefix}_peak_rss_mb_all_processes": peak_all,
        f"{prefix}_cpu_s_by_process": cpu,
        f"{prefix}_cpu_s_total": round(sum(spent.values()), 2),
        f"{prefix}_fleet_cpu_s": round(sum(spent.get(k_, 0.0) for k_ in kinds), 2),
        f"{prefix}_redis_commands_per_turn": round(commands / n, 1),
        f"{prefix}_phase_ms": phases,
    }


# The steps of a bench turn, in order, by their event type (the nth of that type).
_PHASES = (
    ("turn_started", 1),
    ("llm_started", 1),
    ("llm_finished", 1),
    ("tool_started", 1),
    ("tool_finished", 1),
    ("llm_started", 2),
    ("llm_finished", 2),
    ("turn_finished", 1),
)


def _phase_ms(store: Any, ids: list[str], since: float) -> dict[str, list[int]]:
    """When each step of the turns happened, from each turn's event log (read after the
    stage, off the clock): ms since the stage began, as [p50, p90, max] over the turns."""
    from agentq import constants as k

    at: dict[str, list[int]] = {f"{t}#{n}": [] for t, n in _PHASES}
    pipe = store.redis.pipeline()
    for tid in ids:
        pipe.xrange(k.turn_key(tid, "log"))
    for entries in pipe.execute():
        seen: Counter[str] = Counter()
        for sid, fields in entries:
            type_ = json.loads(fields[b"e"])["type"]
            seen[type_] += 1
            name = f"{type_}#{seen[type_]}"
            if name in at:
                at[name].append(int(sid.split(b"-")[0]) - int(since * 1000))
    return {
        name: [int(pct(xs, 50) or 0), int(pct(xs, 90) or 0), max(xs)]
        for name, xs in at.items()
        if xs
    }


def redis_commands(client: Any) -> int:
    """Commands Redis has run since it started (INFO commandstats), scripts' included."""
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def bench_raw_sdk(fx: BenchRig, n: int) -> dict[str, Any]:
    """The io stage's turns as one asyncio loop with the raw OpenAI SDK (its own process,
    scripts/bench_raw_sdk.py): the CPU the model and tool waits cost with nothing around."""
    assert fx.llm is not None
    key = fx.script(
        _stream_round([ScriptedCall(name="aio_sleep", arguments={"seconds": IO_WAIT_S})]),
        _stream_round(),
    )
    script = Path(__file__).resolve().parent / "bench_raw_sdk.py"
    cmd = [sys.executable, str(script), "--base-url", fx.llm.url, "--prompt-key", key]
    done = subprocess.run(
        [*cmd, "--turns", str(n)], capture_output=True, text=True, timeout=300, check=False
    )
    if not done.stdout.strip():
        raise RuntimeError(f"bench_raw_sdk.py failed: {done.stderr[-500:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "raw_sdk_turns": res["turns"],
        "raw_sdk_finished": res["finished"],
        "raw_sdk_seconds": res["seconds"],
        "raw_sdk_cpu_s": res["cpu_s"],
    }


def bench_io(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """1,000 real turns, each an async tool call of 5 s between two 2 s model rounds, on one
    default `agentq worker io` and `agentq worker llm`, and the same turns as one raw-SDK
    asyncio loop (the reference for their CPU); beside it, the old path (a sync tool on the
    prefork tool worker) with 300."""
    out: dict[str, Any] = {}
    out.update(bench_turns_with(fx, sz.io_turns, "aio_sleep", "io_turns"))
    out.update(bench_raw_sdk(fx, sz.io_turns))
    if out.get("raw_sdk_cpu_s"):
        out["io_cpu_vs_raw_sdk"] = round(out["io_turns_fleet_cpu_s"] / out["raw_sdk_cpu_s"], 2)
    out.update(bench_turns_with(fx, sz.old_path_turns, "sleep", "old_path"))
    out["notes"] = [
        f"old_path: sync `sleep` on the prefork tool worker -c {fx.args.tool_concurrency}",
    ]
    return out
