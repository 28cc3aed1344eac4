#!/usr/bin/env python3
"""agentq side by side with plain Celery on the same broker, in one run.

    python scripts/bench.py                 # the full run (about 21 minutes on 2 cores)
    python scripts/bench.py --quick         # smaller samples (about 8 minutes)
    python scripts/bench.py --quick --json  # one JSON object on stdout, the table on stderr
    python scripts/bench.py --use-env-redis # AGENTQ_REDIS_URL instead of an own redis-server
    python scripts/bench.py --profile DIR   # also profile a call's hot path into DIR

It starts its own Redis, the four agentq workers (tools: prefork; turns, llm, io),
a plain Celery worker (scripts/bench_celery_app.py) and the scripted model server, all
on 127.0.0.1, and stops every process it started by PID on the way out. The workers run
with agentq's default settings; only the tool modules and the model URL are set.
The stages are in scripts/bench_stages.py (latency, throughput, scale) and
scripts/bench_capacity.py (held, io) and scripts/bench_model_capacity.py (capacity: model
rounds against a rate-limited provider), the verdicts and tables in scripts/bench_report.py;
this file runs them, counts where a call's Redis commands go, profiles it on request, and
prints the report. `--runs 3` runs each stage three times and reports medians and spreads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentq.fleet import runtime  # noqa: E402
from scripts.bench_capacity import bench_held, bench_io  # noqa: E402
from scripts.bench_cluster import bench_cluster  # noqa: E402
from scripts.bench_conversations import bench_conversations  # noqa: E402
from scripts.bench_first_token import bench_first_token  # noqa: E402
from scripts.bench_model_capacity import bench_model_capacity  # noqa: E402
from scripts.bench_report import TURN_WORKER_SIDE, judge, merge_runs, render  # noqa: E402
from scripts.bench_shapes import bench_shapes  # noqa: E402
from scripts.bench_stages import (  # noqa: E402
    QUICK,
    BenchRig,
    Sizes,
    agentq_call,
    agentq_once,
    bench_abort,
    bench_events,
    bench_overhead,
    bench_scale,
    bench_throughput,
    bench_timeout,
    bench_watchdog,
    celery_once,
    publisher_main,
    redis_monitor,
)
from scripts.bench_waitpoints import bench_waitpoints  # noqa: E402

KEYS = (
    "conversation_turn_ratio_p50",
    "conversation_handoff_ms_p50",
    "conversation_handoff_ms_p99",
    "conversation_extra_redis_commands",
    "budgeted_turn_ratio_p50",
    "agentq_call_ms_p50",
    "agentq_call_ms_p99",
    "celery_call_ms_p50",
    "celery_call_ms_p99",
    "overhead_ratio_p50",
    "overhead_ratio_p99",
    "agentq_calls_per_s",
    "celery_calls_per_s",
    "throughput_ratio",
    "abort_to_event_ms_p50",
    "abort_to_event_ms_p99",
    "abort_to_process_gone_ms_p50",
    "abort_to_process_gone_ms_p99",
    "timeout_overshoot_ms_p50",
    "timeout_overshoot_ms_p99",
    "watchdog_overshoot_ms_p50",
    "watchdog_overshoot_ms_p99",
    "watchdog_keepalive_overshoot_ms_p50",
    "watchdog_keepalive_overshoot_ms_p99",
    "event_latency_ms_p50",
    "event_latency_ms_p99",
    "sse_latency_ms_p50",
    "sse_latency_ms_p99",
    "io_wall_vs_raw_sdk",
    "shapes_worst_cpu_ratio",
    "shapes_worst_wall_ratio",
    "shapes_worst_celery_cpu_ratio",
    "shapes_worst_cpu_vs_celery",
    "shapes_worst_first_token_over_direct_ms_p50",
    "shapes_worst_first_token_over_direct_ms_p99",
    "first_token_agentq_ms_p50",
    "first_token_agentq_ms_p99",
    "first_token_direct_ms_p50",
    "first_token_direct_ms_p99",
    "first_token_over_direct_ms_p50",
    "first_token_over_direct_ms_p99",
    "waitpoint_calls_waiting_at_once",
    "waitpoint_turn_worker_kb_per_call",
    "waitpoint_redis_bytes_per_call",
    "waitpoint_complete_ms_p50",
    "waitpoint_complete_ms_p99",
    "waitpoint_back_to_back_ms_p50",
    "waitpoint_back_to_back_ms_p99",
    "scale_turns",
    "scale_all_settled",
    "scale_seconds",
    "rss_mb",
)
# --------------------------------------------------------------------------- where time goes


def _process_kinds(fx: BenchRig) -> dict[int, str]:
    kinds = {os.getpid(): "caller"}
    if fx.redis is not None:
        kinds[fx.redis.pid] = "redis-server"
    for name, proc in fx.procs.items():
        kinds[proc.pid] = f"{name} worker"
        for child in proc.children_pids():
            kinds[child] = f"{name} pool"
    return kinds


def _cpu_s(kinds: dict[int, str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for pid, kind in kinds.items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[kind] += t.user + t.system
    return out


def _redis_ports(kinds: dict[int, str], redis_port: int) -> dict[str, str]:
    """Client port -> process kind; a pool child inherits its parent's sockets, which
    only the parent uses, so the parent wins."""
    ports: dict[str, str] = {}
    for pid, kind in sorted(kinds.items(), key=lambda kv: kv[1].endswith(" worker")):
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == redis_port:
                    ports[str(conn.laddr.port)] = kind
    return ports


def cost_per_call(fx: BenchRig, n: int = 100) -> dict[str, Any]:
    """CPU ms and Redis commands per no-op call, by process: where a call's time goes.

    CPU time barely depends on what else the machine runs, unlike latency, so it is
    the steadier measure of what agentq adds to a call. The call is sent as a model turn
    sends its calls: by the process that learned of them (there the stream worker, after
    the round that asked for them; here the caller). The same call sent by a turn
    worker's step, one Celery delivery more, is measured beside it.
    """
    import redis as redis_py

    url = fx.env["AGENTQ_REDIS_URL"]
    port = int(redis_py.Redis.from_url(url).connection_pool.connection_kwargs.get("port", 6379))
    # The client's side as Celery's: start, wait, read the result (no timing reads).
    sides: dict[str, Callable[[], object]] = {
        "agentq": lambda: agentq_call(fx, step_here=True),
        TURN_WORKER_SIDE: lambda: agentq_call(fx, step_here=False),
        "celery": celery_once,
    }
    worker = {"agentq": "tools", TURN_WORKER_SIDE: "tools", "celery": "celery"}
    cpu: dict[str, Counter[str]] = {side: Counter() for side in sides}
    order = list(sides)
    for _rep in range(4):
        # Each side goes first, middle and last in turn, so machine noise hits all three.
        order = order[1:] + order[:1]
        for side in order:
            kinds = _process_kinds(fx)
            before = _cpu_s(kinds)
            for _ in range(n // 2):
                sides[side]()
            after = _cpu_s(kinds)
            cpu[side].update({k_: after[k_] - before.get(k_, 0.0) for k_ in after})
    out: dict[str, Any] = {}
    for side, once in sides.items():

        def calls_of(once: Callable[[], object] = once) -> None:
            for _ in range(n):
                once()

        seen = redis_monitor(url, calls_of)
        kinds = _process_kinds(fx)
        ports = _redis_ports(kinds, port)
        by_kind: dict[str, Counter[str]] = {}
        for cport, name in seen:
            kind = "inside Lua" if not cport.isdigit() else ports.get(cport, "other")
            by_kind.setdefault(kind, Counter())[name] += 1
        calls = 2 * n  # the CPU windows: 4 reps of n // 2
        # Only the processes on the call's path: the other workers idle alike for all.
        path: tuple[str, ...] = (
            "caller",
            "redis-server",
            f"{worker[side]} worker",
            f"{worker[side]} pool",
        )
        if side != "celery":
            path += ("turns worker",)  # its sweeps; on the other side, its step as well
        cpu_ms = {k_: round(cpu[side][k_] * 1000 / calls, 3) for k_ in path}
        out[side] = {
            "cpu_ms_per_call": {**cpu_ms, "total": round(sum(cpu_ms.values()), 3)},
            "redis_commands_per_call": {
                kind: {
                    "total": round(sum(c.values()) / n, 2),
                    **{k_: round(v / n, 2) for k_, v in c.most_common(8)},
                }
                for kind, c in sorted(by_kind.items())
            },
        }
    # The processes that idle alike for all sides (the other workers' heartbeats and
    # sweeps) are left out, as for the CPU above.
    idle = ("io pool", "io worker", "llm pool", "llm worker", "other")
    cmds = {
        side: round(
            sum(
                v["total"]
                for kind, v in out[side]["redis_commands_per_call"].items()
                if kind not in idle and kind != ("turns worker" if side == "celery" else "")
            ),
            2,
        )
        for side in out
    }
    cpu_total = {side: out[side]["cpu_ms_per_call"]["total"] for side in out}
    c = cpu_total["celery"]
    return {
        "cost_per_call": out,
        "agentq_cpu_ms_per_call": cpu_total["agentq"],
        "celery_cpu_ms_per_call": c,
        "cpu_ratio": round(cpu_total["agentq"] / c, 3) if c else None,
        "cpu_ratio_turn_worker": round(cpu_total[TURN_WORKER_SIDE] / c, 3) if c else None,
        "agentq_redis_commands_per_call": cmds["agentq"],
        "celery_redis_commands_per_call": cmds["celery"],
        "redis_commands_ratio": round(cmds["agentq"] / cmds["celery"], 2)
        if cmds["celery"]
        else None,
        "redis_commands_ratio_turn_worker": round(cmds[TURN_WORKER_SIDE] / cmds["celery"], 2)
        if cmds["celery"]
        else None,
    }


def with_io_ratios(out: dict[str, Any]) -> dict[str, Any]:
    """The io stage's wall time against the raw-SDK loop's, beside its CPU ratio."""
    if out.get("raw_sdk_seconds") and out.get("io_turns_seconds"):
        out["io_wall_vs_raw_sdk"] = round(out["io_turns_seconds"] / out["raw_sdk_seconds"], 2)
    return out


def profile(fx: BenchRig, out_dir: Path, n: int = 300) -> dict[str, str]:
    """pyinstrument on the dispatcher side; py-spy on the tool worker while it runs."""
    from pyinstrument import Profiler

    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    tool_pid = fx.procs["tools"].pid
    spy_out = out_dir / "tool-worker.pyspy.txt"
    spy = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(tool_pid),
            "--subprocesses",
            "--rate",
            "500",
            "--format",
            "raw",
            "--nonblocking",
            "-o",
            str(spy_out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)
        prof = Profiler(interval=0.0005)
        prof.start()
        for _ in range(n):
            agentq_once(fx)
        prof.stop()
        path = out_dir / "dispatcher.pyinstrument.txt"
        path.write_text(prof.output_text(unicode=True, show_all=False))
        files["dispatcher"] = str(path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(spy.pid, 2)  # SIGINT: py-spy writes its output and exits
        try:
            spy.wait(20)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    if spy_out.exists():
        files["tool_worker"] = str(spy_out)
    return files


# --------------------------------------------------------------------------- the report


def machine(fx: BenchRig) -> dict[str, Any]:
    import celery
    import kombu
    import redis as redis_py

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    server = "?"
    with contextlib.suppress(Exception):
        server = str(runtime.get_store().redis.info("server").get("redis_version"))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis_py": redis_py.__version__,
        "redis_server": server,
        "tool_concurrency": fx.args.tool_concurrency,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "python_loop_ms_at_start": python_loop_ms(),
    }


def python_loop_ms(reps: int = 5) -> float:
    """The fastest of `reps` timings of a fixed pure-Python loop: how fast this (virtual)
    machine runs Python now. On a shared VM it moved by half within minutes, and every
    absolute figure with it; compare it across runs before comparing their times."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x = 0
        for i in range(1_000_000):
            x += i
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sz = QUICK if args.quick else Sizes()
    if args.scale_turns:
        sz = Sizes(**{**sz.__dict__, "scale_turns": args.scale_turns})
    if args.io_turns:
        sz = Sizes(**{**sz.__dict__, "io_turns": args.io_turns})
    if args.capacity_turns:
        sz = Sizes(**{**sz.__dict__, "capacity_turns": args.capacity_turns})
    if args.old_path_turns:
        sz = Sizes(**{**sz.__dict__, "old_path_turns": args.old_path_turns})
    if args.waitpoint_calls:
        sz = Sizes(**{**sz.__dict__, "waitpoint_calls": args.waitpoint_calls})
    started = time.perf_counter()
    fx = BenchRig(args)
    res: dict[str, Any] = {"quick": args.quick, "runs": args.runs}
    notes: list[str] = []
    try:
        fx.start()
        notes += fx.notes
        res["machine"] = machine(fx)
        res["llm_api"] = args.llm_api
        stages: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("overhead", lambda: bench_overhead(fx, sz)),
            ("throughput", lambda: bench_throughput(fx, sz)),
            ("timeout", lambda: bench_timeout(fx, sz)),
            ("abort", lambda: bench_abort(fx, sz)),
            ("watchdog", lambda: bench_watchdog(fx, sz)),
            ("events", lambda: bench_events(fx, sz)),
            ("scale", lambda: bench_scale(fx, sz)),
            ("held", lambda: bench_held(fx, sz)),
            ("io", lambda: with_io_ratios(bench_io(fx, sz))),
            ("shapes", lambda: bench_shapes(fx, sz)),
            ("first_token", lambda: bench_first_token(fx, sz)),
            ("capacity", lambda: bench_model_capacity(fx, sz)),
            ("cluster", lambda: bench_cluster(fx, sz)),
            ("conversations", lambda: bench_conversations(fx, sz)),
            ("waitpoints", lambda: bench_waitpoints(fx, sz)),
        ]
        if not args.no_cost:
            stages.append(("cost_per_call", lambda: cost_per_call(fx)))
        if args.profile:
            stages.append(("profile", lambda: {"profile_files": profile(fx, Path(args.profile))}))
        only = set(args.only.split(",")) if args.only else None
        for name, stage in stages:
            if only and name not in only:
                continue
            left = fx.drain()
            if left:
                notes.append(f"{name}: {left} messages of earlier stages still queued at its start")
            t0 = time.perf_counter()
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            outs: list[dict[str, Any]] = []
            for rep in range(1 if name in ("cost_per_call", "profile") else args.runs):
                try:
                    out = stage()
                except Exception as exc:
                    notes.append(f"{name} (run {rep + 1}): failed: {type(exc).__name__}: {exc}")
                    continue
                notes += out.pop("notes", [])
                outs.append(out)
            if outs:
                res.update(merge_runs(outs))
            print(
                f"bench: {name} done in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        fx.stop()
    res["duration_s"] = round(time.perf_counter() - started, 1)
    load = os.getloadavg()[0]
    if "machine" in res:
        res["machine"]["load_avg_1m_at_end"] = round(load, 2)
        res["machine"]["python_loop_ms_at_end"] = python_loop_ms()
    cores = os.cpu_count() or 1
    if max(load, res.get("machine", {}).get("load_avg_1m_at_start", 0)) > cores:
        notes.append(
            f"the machine was busy (1-minute load {load:.1f} on {cores} cores): "
            "absolute figures are noisy; the interleaved ratios less so"
        )
    for key in KEYS:  # --json always carries every key; null when not measured
        res.setdefault(key, None)
    res["goals"] = judge(res)
    res["notes"] = notes
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smaller samples; about 8 minutes")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument(
        "--use-env-redis",
        action="store_true",
        help="use AGENTQ_REDIS_URL instead of starting a redis-server (one that "
        "no other agentq fleet consumes from: the bench starts its own workers)",
    )
    p.add_argument(
        "--tool-concurrency",
        type=int,
        default=8,
        help="prefork processes of the agentq tool worker and the Celery worker",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run each stage this many times and report the median and spread (3 for figures)",
    )
    p.add_argument("--scale-turns", type=int, default=0, help="turns of the scale stage")
    p.add_argument("--io-turns", type=int, default=0, help="turns of the io stage (1000)")
    p.add_argument(
        "--waitpoint-calls", type=int, default=0, help="calls of the waitpoints stage (10000)"
    )
    p.add_argument(
        "--old-path-turns",
        type=int,
        default=0,
        help="turns of the io stage's sync-tool comparison (300)",
    )
    p.add_argument(
        "--capacity-turns",
        type=int,
        default=0,
        help="turns of the capacity stage's runs at 20 requests/s (300)",
    )
    p.add_argument(
        "--capacity-shapes",
        default="",
        help="the capacity stage's provider shapes, comma-separated (default: all)",
    )
    p.add_argument(
        "--shapes",
        default="",
        help="the shapes stage's shapes, comma-separated indices from 0 (default: all seven)",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated stages to run: overhead, "
        "throughput, timeout, abort, watchdog, events, scale, held, io, shapes, first_token, "
        "capacity, "
        "cluster, conversations, waitpoints, "
        "cost_per_call, "
        "profile",
    )
    p.add_argument(
        "--no-cost",
        action="store_true",
        help="skip measuring CPU and Redis commands per call (uses MONITOR)",
    )
    p.add_argument(
        "--profile", metavar="DIR", default="", help="also profile the hot path of a call into DIR"
    )
    p.add_argument(
        "--llm-api",
        choices=["chat", "responses"],
        default="chat",
        help="the model API the workers call (AGENTQ_LLM_API): run io and first_token on each",
    )
    p.add_argument("--log-dir", default="", help="keep the workers' logs here")
    p.add_argument("--publisher", help=argparse.SUPPRESS)
    p.add_argument("--publish-n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--publish-interval-ms", type=float, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.publisher:
        return publisher_main(args.publisher, args.publish_n, args.publish_interval_ms)
    # A SIGTERM (a `timeout`, a CI runner's stop) unwinds like Ctrl-C, so `run` stops every
    # process it started instead of leaving the fleet running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args)
    render(res, to_stderr=args.json)
    if args.json:
        print(json.dumps(res, default=str))
    # Missed goals are findings, not failures; a stage that could not measure is one.
    return (
        0 if all(res.get(k) is not None for k in ("overhead_ratio_p50", "throughput_ratio")) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
