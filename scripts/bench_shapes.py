"""The io stage on several workload shapes (`shapes`): each shape's turns on the fleet and
the same turns as a raw-SDK asyncio loop, one after the other in one run, with the ratios of
their CPU and wall time.

The io stage's own shape (keep-alive connections, 80 characters over 2 s, one async tool)
is one of many a fleet meets: a server that closes the connection after each stream,
answers long or short, streamed a word at a time or in one burst, one round or several,
tools sync or async. An improvement measured on one shape only may not carry to another.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_capacity import bench_turns_with
from scripts.bench_first_token import first_tokens, over_direct
from scripts.bench_stages import BenchRig, Sizes, pct


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
    for shape in _chosen(fx):
        key = fx.script(*shape.script())
        kinds = ("turns", "llm", "tools" if shape.sync else "io")
        with spied(fx, f"shape{len(rows)}", kinds):
            fleet = bench_turns_with(fx, n, shape.tool, "f", key=key, floor_s=shape.floor_s())
        raw = raw_loop(fx, key, n, shape)
        if not fleet["f_all_settled"] or raw["finished"] != n:
            notes.append(
                f"shapes: {shape.name}: fleet {fleet['f_statuses']}, raw loop "
                f"{raw['finished']}/{n} ({raw.get('errors')})"
            )
        rows.append(
            {
                "shape": shape.name,
                "index": SHAPES.index(shape),
                "turns": n,
                "floor_s": round(shape.floor_s(), 2),
                "fleet_s": fleet["f_seconds"],
                "raw_s": raw["seconds"],
                "fleet_cpu_s": fleet["f_fleet_cpu_s"],
                "raw_cpu_s": raw["cpu_s"],
                "cpu_ratio": round(fleet["f_fleet_cpu_s"] / raw["cpu_s"], 2)
                if raw["cpu_s"]
                else None,
                "wall_ratio": round(fleet["f_seconds"] / raw["seconds"], 2)
                if raw["seconds"]
                else None,
                "fleet_cpu_s_by_process": fleet["f_cpu_s_by_process"],
            }
        )
    _first_tokens(fx, sz, rows)
    # Flat keys too: a stage run several times reports each number's median.
    flat = {f"shape_{r['index']}_{m}": r.get(m) for r in rows for m in SHAPE_FIGURES}
    return {
        **flat,
        "shapes": rows,
        **{f"shapes_worst_{m}": _worst(rows, m) for m in SHAPE_FIGURES},
        "notes": notes,
    }


SHAPE_FIGURES = (
    "cpu_ratio",
    "wall_ratio",
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
