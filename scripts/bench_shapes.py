"""The io stage on several workload shapes (`shapes`): each shape's turns on the fleet, as
plain Celery tasks and as a raw-SDK asyncio loop, one after the other in one run, with the
ratios of their CPU and wall time.

The io stage's own shape (keep-alive connections, 80 characters over 2 s, one async tool)
is one of many a fleet meets: a server that closes the connection after each stream,
answers long or short, streamed a word at a time or in one burst, one round or several,
tools sync or async. An improvement measured on one shape only may not carry to another.

The plain Celery turn (`scripts.bench_celery_app.turn_round`) is the floor of any design that
hands each round and each tool call to Celery: where it costs more than the raw loop, the
fleet's ratio to it says how much of the difference is agentq's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentq.fleet import runtime
from agentq.local.processes import CELERY_READY_PATTERN, ManagedProcess
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_capacity import bench_turns_with, cpu_s_by_kind
from scripts.bench_first_token import first_tokens, over_direct
from scripts.bench_raw_sdk import TURNS_PER_CLIENT
from scripts.bench_stages import READY_TIMEOUT_S, ROOT, BenchRig, Sizes, pct


@dataclass(frozen=True)
class Shape:
    """One workload: what the model streams, how the server treats the connection, which
    tool a round calls."""

    name: str
    close: bool = False
    """The server closes the connection after each stream (some proxies and servers do)."""
    words: int = 16
    word_ms: int = 125
    """The pace of the answer: a word (5 characters) every `word_ms`; 0: one burst."""
    rounds: int = 2
    """Model rounds a turn has; every one but the last calls the tool once."""
    tool: str = "aio_sleep"
    tool_s: float = 2.0

    @property
    def sync(self) -> bool:
        """The tool runs on the prefork tool worker (the raw loop: in a thread)."""
        return not self.tool.startswith("aio")

    def stream(self, calls: list[ScriptedCall]) -> Round:
        """One round of the shape, calling `calls` after its words."""
        return Round(
            text="word " * self.words,
            chunk_size=5,
            chunk_delay_ms=self.word_ms,
            close_connection=self.close,
            tool_calls=calls,
        )

    def script(self) -> list[Round]:
        call = ScriptedCall(name=self.tool, arguments={"seconds": self.tool_s})
        return [self.stream([call]) for _ in range(self.rounds - 1)] + [self.stream([])]

    def first_stream(self) -> tuple[int, int, bool]:
        """What decides the shape's first token: its stream's words, pace and connection."""
        return self.words, self.word_ms, self.close

    def floor_s(self) -> float:
        stream_s = self.words * self.word_ms / 1000
        return self.rounds * stream_s + (self.rounds - 1) * self.tool_s


SHAPES = (
    Shape("keep-alive, 16 words a round"),
    Shape(
        "connection closed after each stream, 10 words at 0.2 s", close=True, words=10, word_ms=200
    ),
    Shape("long answer: 400 words at 5 ms", words=400, word_ms=5),
    Shape("burst: 60 words at once", words=60, word_ms=0),
    Shape("one round, no tool", rounds=1),
    Shape("five rounds", rounds=5, words=8, tool_s=0.5),
    # `stamp` is a bare `time.sleep`, as the raw loop's thread runs: the same tool body on
    # both sides (the `sleep` tool also reports progress twice a second).
    Shape("sync tool on the prefork worker", tool="stamp"),
)


def raw_loop(fx: BenchRig, key: str, n: int, shape: Shape) -> dict[str, Any]:
    """The shape's turns as one asyncio loop with the raw OpenAI SDK (its own process)."""
    assert fx.llm is not None
    script = Path(__file__).resolve().parent / "bench_raw_sdk.py"
    cmd = [sys.executable, str(script), "--base-url", fx.llm.url, "--prompt-key", key]
    cmd += ["--turns", str(n)]
    if shape.sync:
        # A sync tool in the raw loop: a thread pool as wide as the fleet's tool processes.
        cmd += ["--sync-tool-threads", str(fx.args.tool_concurrency)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if not done.stdout.strip():
        raise RuntimeError(f"bench_raw_sdk.py failed: {done.stderr[-500:]}")
    res: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return res


PLAIN_ROUNDS = "celery rounds"
PLAIN_SYNC_TOOLS = "celery sync tools"


def plain_kinds(shape: Shape) -> tuple[str, ...]:
    """The plain Celery turn's worker kinds a shape runs on."""
    return (PLAIN_ROUNDS, *((PLAIN_SYNC_TOOLS,) if shape.sync else ()))


@contextlib.contextmanager
def plain_celery_workers(fx: BenchRig, n: int, sync: bool) -> Iterator[None]:
    """The plain Celery turn's workers, for the stage only: a thread pool as wide as the
    turns at once for the rounds (and the async-shaped tools), and, for a sync tool, a
    prefork pool as wide as agentq's tool worker."""
    from scripts.bench_celery_app import ROUNDS, SYNC_TOOLS

    assert fx.local is not None
    local = fx.local

    clients = {"BENCH_PLAIN_CLIENTS": str(-(-n // TURNS_PER_CLIENT))}

    def worker(kind: str, pool: str, concurrency: int, queue: str) -> ManagedProcess:
        argv = [sys.executable, "-m", "celery", "-A", "scripts.bench_celery_app", "worker"]
        argv += ["-P", pool, "-c", str(concurrency), "-Q", queue, "--loglevel", "INFO"]
        argv += ["--hostname", f"bench-{kind.replace(' ', '-')}-{fx.run_id}@%h"]
        return local.start(
            kind,
            argv,
            env=clients if pool == "threads" else None,
            cwd=ROOT,
            ready_pattern=CELERY_READY_PATTERN,
            ready_timeout_s=READY_TIMEOUT_S,
        )

    wanted = [(PLAIN_ROUNDS, "threads", n, ROUNDS)]
    if sync:
        wanted.append((PLAIN_SYNC_TOOLS, "prefork", fx.args.tool_concurrency, SYNC_TOOLS))
    with ThreadPoolExecutor(len(wanted)) as pool:
        futures = [pool.submit(worker, *w) for w in wanted]
    try:
        for f in futures:
            f.result()
        yield
    finally:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
                local.retire(f.result())


def plain_celery(fx: BenchRig, key: str, n: int, shape: Shape) -> dict[str, Any]:
    """The shape's turns as plain Celery tasks: seconds, and CPU of its workers + Redis."""
    from scripts.bench_celery_app import ROUNDS, SYNC_TOOLS, turn_round

    r = runtime.get_store().redis
    done_key = f"bench:plain:{uuid.uuid4().hex}"
    kinds = (*plain_kinds(shape), "redis")
    tool_queue = SYNC_TOOLS if shape.sync else ROUNDS
    before = cpu_s_by_kind(fx)
    t0 = time.perf_counter()
    for i in range(n):
        turn_round.apply_async(
            ([{"role": "user", "content": f"{key} #{i}"}], done_key, tool_queue), queue=ROUNDS
        )
    finished = 0
    while time.perf_counter() - t0 < 300:
        finished = int(r.get(done_key) or 0)
        if finished >= n:
            break
        time.sleep(0.05)
    took = time.perf_counter() - t0
    after = cpu_s_by_kind(fx)
    r.delete(done_key)
    spent = {kind: round(after.get(kind, 0.0) - before.get(kind, 0.0), 2) for kind in kinds}
    return {
        "finished": finished,
        "seconds": round(took, 2),
        "cpu_s": round(sum(spent.values()), 2),
        "cpu_s_by_process": spent,
    }


@contextlib.contextmanager
def spied(fx: BenchRig, tag: str, kinds: tuple[str, ...]) -> Any:
    """py-spy on each of `kinds` (pool children too) while the block runs, when the bench
    was given --profile DIR: one collapsed-stack file per process kind."""
    out_dir = getattr(fx.args, "profile", None)
    if not out_dir:
        yield
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    spies = []
    for kind in kinds:
        out = Path(out_dir) / f"{tag}-{kind}.pyspy.txt"
        argv = ["py-spy", "record", "--pid", str(fx.procs[kind].pid), "--subprocesses"]
        argv += ["--rate", "200", "--gil", "--format", "raw", "--nonblocking", "-o", str(out)]
        spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        yield
    finally:
        for spy in spies:
            with contextlib.suppress(ProcessLookupError):
                os.kill(spy.pid, 2)  # SIGINT: py-spy writes its output and exits
        for spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


def _chosen(fx: BenchRig) -> tuple[Shape, ...]:
    """The shapes this run measures (`--shapes`: indices into SHAPES, default all)."""
    chosen = getattr(fx.args, "shapes", "")
    if not chosen:
        return SHAPES
    picked = [int(i) for i in chosen.split(",") if i.strip()]
    if any(not 0 <= i < len(SHAPES) for i in picked):
        raise ValueError(f"--shapes takes indices 0..{len(SHAPES) - 1}, not {chosen!r}")
    return tuple(SHAPES[i] for i in picked)


def bench_shapes(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """Each shape on the fleet, then on the raw loop: CPU (fleet + Redis) and wall ratios."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    n = sz.shape_turns
    shapes = _chosen(fx)
    with plain_celery_workers(fx, n, any(s.sync for s in shapes)):
        for shape in shapes:
            rows.append(_one_shape(fx, n, shape, notes))
    _first_tokens(fx, sz, rows)
    # Flat keys too: a stage run several times reports each number's median.
    flat = {f"shape_{r['index']}_{m}": r.get(m) for r in rows for m in SHAPE_FIGURES}
    return {
        **flat,
        "shapes": rows,
        **{f"shapes_worst_{m}": _worst(rows, m) for m in SHAPE_FIGURES},
        "notes": notes,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def _one_shape(fx: BenchRig, n: int, shape: Shape, notes: list[str]) -> dict[str, Any]:
    """One shape on the fleet, as plain Celery tasks and on the raw loop, in that order."""
    key = fx.script(*shape.script())
    index = SHAPES.index(shape)
    kinds = ("turns", "llm", "tools" if shape.sync else "io")
    with spied(fx, f"shape{index}", kinds):
        fleet = bench_turns_with(fx, n, shape.tool, "f", key=key, floor_s=shape.floor_s())
    with spied(fx, f"shape{index}-plain", plain_kinds(shape)):
        plain = plain_celery(fx, key, n, shape)
    raw = raw_loop(fx, key, n, shape)
    if not fleet["f_all_settled"] or raw["finished"] != n or plain["finished"] != n:
        notes.append(
            f"shapes: {shape.name}: fleet {fleet['f_statuses']}, plain Celery "
            f"{plain['finished']}/{n}, raw loop {raw['finished']}/{n} ({raw.get('errors')})"
        )
    return {
        "shape": shape.name,
        "index": index,
        "turns": n,
        "floor_s": round(shape.floor_s(), 2),
        "fleet_s": fleet["f_seconds"],
        "celery_s": plain["seconds"],
        "raw_s": raw["seconds"],
        "fleet_cpu_s": fleet["f_fleet_cpu_s"],
        "celery_cpu_s": plain["cpu_s"],
        "raw_cpu_s": raw["cpu_s"],
        "cpu_ratio": _ratio(fleet["f_fleet_cpu_s"], raw["cpu_s"]),
        "wall_ratio": _ratio(fleet["f_seconds"], raw["seconds"]),
        "celery_cpu_ratio": _ratio(plain["cpu_s"], raw["cpu_s"]),
        "celery_wall_ratio": _ratio(plain["seconds"], raw["seconds"]),
        "cpu_vs_celery": _ratio(fleet["f_fleet_cpu_s"], plain["cpu_s"]),
        "fleet_cpu_s_by_process": fleet["f_cpu_s_by_process"],
        "celery_cpu_s_by_process": plain["cpu_s_by_process"],
    }


SHAPE_FIGURES = (
    "cpu_ratio",
    "wall_ratio",
    "celery_cpu_ratio",
    "celery_wall_ratio",
    "cpu_vs_celery",
    "first_token_over_direct_ms_p50",
    "first_token_over_direct_ms_p99",
)
"""Each shape's figures, reported flat (`shape_<i>_<figure>`) for the medians of runs."""


def _first_tokens(fx: BenchRig, sz: Sizes, rows: list[dict[str, Any]]) -> None:
    """Each shape's first token, as the `first_token` stage measures it (`POST /v1/turns`
    to the first `llm_delta` on SSE, against the SDK direct), on the shape's first stream:
    turns one at a time, each aborted at its first delta. Shapes whose first streams are
    alike share one measurement."""
    from agentq import constants as k
    from agentq.fleet import runtime

    if not fx.gateway_url:
        return
    measured: dict[tuple[int, int, bool], dict[str, Any]] = {}
    for row in rows:
        shape = SHAPES[row["index"]]
        first = shape.first_stream()
        if first not in measured:
            key = fx.script(shape.stream([]))
            sides, phases = first_tokens(fx, key, sz.shape_first_token_samples, 3, whole=False)
            measured[first] = {
                "agentq_slowest_first_token_phases_ms": _slowest(sides["agentq"], phases),
                **{
                    f"{side}_first_token_ms_p{q}": round((pct(xs, q) or 0) * 1000, 1)
                    for side, xs in sides.items()
                    for q in (50, 99)
                },
                **over_direct(sides, "first_token"),
            }
        row.update(measured[first])
    # The aborted turns end before the next stage starts.
    store = runtime.get_store()
    deadline = time.monotonic() + 60
    while store.redis.zcard(k.WAKEUPS) and time.monotonic() < deadline:
        time.sleep(0.05)


def _slowest(samples: list[float], phases: dict[str, list[float]]) -> dict[str, float]:
    """Where agentq's slowest first token's time went: each phase's ms from its POST."""
    i = max(range(len(samples)), key=samples.__getitem__)
    return {name: round(xs[i] * 1000, 1) for name, xs in phases.items() if len(xs) == len(samples)}


def _worst(rows: list[dict[str, Any]], figure: str) -> float | None:
    xs = [r[figure] for r in rows if r.get(figure) is not None]
    return max(xs) if xs else None
