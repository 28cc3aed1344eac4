"""The measurements of scripts/bench.py: the fleet it runs on, and one function per stage.

Every stage takes the running :class:`BenchRig` and the sample :class:`Sizes` and returns
a flat dict of figures (milliseconds and ratios rounded to 3 places; ``notes`` for what
could not be measured), which bench.py merges into its one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import select
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentq.events import TERMINAL_TYPES
from agentq.events.follow import follow
from agentq.fleet import runtime
from agentq.local.fleet import LocalFleet, memory_mb
from agentq.local.processes import CELERY_READY_PATTERN, ManagedProcess, start_process
from agentq.local.redis_server import RedisServer, find_free_port
from agentq.models import ToolCall, ToolResult, TurnStatus
from agentq.testing.openai_server import Round, ScriptedCall, ScriptedOpenAIServer
from agentq.testing.scripts import Fault
from tests.rigs.ratelimit import ProviderLimits
from tests.rigs.rounds import run_round, start_round

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent / "bench.py"


class BenchError(RuntimeError):
    """A measurement could not be taken (a call did not settle as expected)."""


READY_TIMEOUT_S = 120.0
"""How long each process of the fleet may take to say it is ready: on the shared 2-core VM,
with other suites running (1-minute load above 20), five Celery workers starting side by
side took longer than the default 30 s."""


@dataclass(frozen=True)
class Sizes:
    overhead_calls: int = 300
    warmup: int = 30
    block: int = 25
    throughput_calls: int = 1000
    throughput_reps: int = 3
    aborts: int = 20
    timeouts: int = 10
    watchdogs: int = 20
    events: int = 1000
    scale_turns: int = 200
    held_turns: int = 1000
    io_turns: int = 1000
    old_path_turns: int = 300
    capacity_turns: int = 300
    capacity_bulk_turns: int = 500
    capacity_interactive_turns: int = 10
    cluster_turns: int = 300
    conversation_turns: int = 100
    conversation_handoffs: int = 200
    first_token_samples: int = 200
    shape_turns: int = 300
    shape_first_token_samples: int = 60
    waitpoint_calls: int = 10_000


QUICK = Sizes(
    300,
    20,
    25,
    300,
    3,
    10,
    5,
    10,
    300,
    50,
    200,
    200,
    60,
    60,
    100,
    5,
    100,
    shape_turns=100,
    shape_first_token_samples=20,
    waitpoint_calls=200,
)


def turn_statuses(store: Any, turn_ids: list[str]) -> list[Any]:
    """Each turn's status, in one round trip (None for a turn Redis does not have)."""
    from agentq import constants as k

    pipe = store.redis.pipeline(transaction=False)  # reads: no MULTI/EXEC to count
    for tid in turn_ids:
        pipe.hget(k.turn_key(tid), "status")
    return [None if s is None else json.loads(s) for s in pipe.execute()]


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated; None for no samples."""
    s = sorted(xs)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ms_stats(prefix: str, xs_s: list[float]) -> dict[str, float | None]:
    ms = [x * 1000 for x in xs_s]
    return {f"{prefix}_p50": _r(pct(ms, 50)), f"{prefix}_p99": _r(pct(ms, 99))}


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


# --------------------------------------------------------------------------- the fleet


class BenchRig:
    """Redis, the scripted model and a LocalFleet of the workers (and the gateway if it exists)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:6]
        self.redis: RedisServer | None = None
        self.llm: ScriptedOpenAIServer | None = None
        self.limits = ProviderLimits()
        """The model server's rate limits (off until a stage sets them)."""
        self.local: LocalFleet | None = None
        self.env: dict[str, str] = {}
        self.gateway_url: str | None = None
        self.notes: list[str] = []

    def start(self) -> None:
        a = self.args
        if a.use_env_redis and os.environ.get("AGENTQ_REDIS_URL"):
            url = os.environ["AGENTQ_REDIS_URL"]
        else:
            self.redis = RedisServer().start()
            url = self.redis.url
        self.llm = ScriptedOpenAIServer(rate_limit=self.limits, keep_requests=False).start()
        self.env = {
            "AGENTQ_REDIS_URL": url,
            "AGENTQ_TOOLS": "agentq.testing.tools,tests.waitpoint_tools",
            "AGENTQ_LLM_BASE_URL": self.llm.url,
            "AGENTQ_LLM_API": getattr(a, "llm_api", "chat"),
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.update(self.env)
        runtime.reset()
        import agentq.testing.tools  # noqa: F401  (the dispatcher validates against the registry)
        import tests.waitpoint_tools  # noqa: F401

        logs = Path(a.log_dir) if a.log_dir else None
        conc = str(a.tool_concurrency)
        fleet = self.local = LocalFleet(self.env, log_dir=logs, redis=self.redis)

        def host(kind: str) -> str:
            return f"bench-{kind}-{self.run_id}"

        starters: dict[str, Callable[[], ManagedProcess]] = {
            # Not the held stage's queue: that stage brings its own 2-process worker.
            "tools": lambda: fleet.start_worker(
                "tools",
                name=host("tools"),
                ready_timeout_s=READY_TIMEOUT_S,
                concurrency=a.tool_concurrency,
                extra_args=("-Q", "agentq.tools"),
            ),
            # A default turn worker: steps are short, a waiting turn holds no thread.
            "turns": lambda: fleet.start_worker(
                "turns", name=host("turns"), ready_timeout_s=READY_TIMEOUT_S
            ),
            # Default options, as `agentq worker llm` / `agentq worker io` start.
            "llm": lambda: fleet.start_worker(
                "llm", name=host("llm"), ready_timeout_s=READY_TIMEOUT_S
            ),
            "io": lambda: fleet.start_worker(
                "io", name=host("io"), ready_timeout_s=READY_TIMEOUT_S
            ),
            "celery": lambda: fleet.start(
                "celery",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "scripts.bench_celery_app",
                    "worker",
                    "-P",
                    "prefork",
                    "-c",
                    conc,
                    "-Q",
                    "bench.noop",
                    "--hostname",
                    f"{host('celery')}@%h",
                    "--loglevel",
                    "INFO",
                ],
                cwd=ROOT,
                ready_pattern=CELERY_READY_PATTERN,
                ready_timeout_s=READY_TIMEOUT_S,
            ),
        }
        if _gateway_available():
            port = find_free_port()
            starters["gateway"] = lambda: fleet.start(
                "gateway",
                [
                    sys.executable,
                    "-m",
                    "agentq",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                cwd=ROOT,
                ready_pattern=r"Uvicorn running on|Application startup complete",
                ready_timeout_s=READY_TIMEOUT_S,
            )
            self.gateway_url = f"http://127.0.0.1:{port}"
        # Started side by side: each Celery worker takes seconds to boot on 2 cores.
        with ThreadPoolExecutor(len(starters)) as pool:
            futures = {k: pool.submit(fn) for k, fn in starters.items()}
            errors = []
            for kind, fut in futures.items():
                try:
                    fut.result()
                except Exception as exc:
                    errors.append(f"{kind}: {exc}")
        # Without the gateway only the SSE figure is missing; say so and go on.
        for err in [e for e in errors if e.startswith("gateway:")]:
            self.notes.append(f"the gateway did not start, no SSE figure: {err[:300]}")
            self.gateway_url = None
            errors.remove(err)
        if errors:
            raise BenchError("could not start the fleet:\n" + "\n".join(errors))

    @property
    def procs(self) -> dict[str, ManagedProcess]:
        """The fleet's processes by kind ("tools", ..., "celery", "gateway")."""
        if self.local is None:
            return {}
        return {self.local.kinds.get(n, n): p for n, p in self.local.procs.items()}

    def stop(self) -> None:
        # Side by side, like the start: each warm shutdown takes a second or two; Redis last.
        if self.local is not None:
            self.local.stop()
            self.local = None
        elif self.redis is not None:
            self.redis.stop()
        if self.llm is not None:
            self.llm.stop()

    # -- helpers shared by the stages

    def script(self, *rounds: Round) -> str:
        assert self.llm is not None
        key = f"bench-{uuid.uuid4().hex[:10]}"
        self.llm.set_script(key, list(rounds))
        return key

    def drain(self, timeout_s: float = 120.0) -> int:
        """Wait until agentq's queues are empty, so a stage does not time the last one's
        backlog (after 10,000 waitpoint turns, its steps ran for seconds into the next
        stage); the messages left when `timeout_s` ran out."""
        from agentq import constants as k
        from agentq.fleet.broker import queue_size

        queues = (k.QUEUE_TURNS, k.QUEUE_TOOLS, k.QUEUE_IO, k.QUEUE_LLM)
        deadline = time.monotonic() + timeout_s
        while True:
            left = sum(queue_size(runtime.get_app(), q) or 0 for q in queues)
            if left == 0 or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def memory_mb(self, measure: str = "rss") -> dict[str, float]:
        """Memory of each process kind, its pool children included (rss or pss)."""
        pids = {kind: p.pid for kind, p in self.procs.items()}
        if self.redis is not None:
            pids["redis"] = self.redis.pid
        return memory_mb(pids, measure)


def _gateway_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("agentq.gateway.server") is not None
    except (ImportError, ValueError):
        return False


def noop_call() -> ToolCall:
    return ToolCall(id=f"c_{uuid.uuid4().hex[:12]}", name="noop", arguments="{}")


QUIET_WAIT_S = 0.015
"""How long the overhead stage's client keeps still before it looks for the turn's end."""


def agentq_call(fx: BenchRig, *, step_here: bool) -> ToolResult:
    """One no-op call as a client makes it: start the turn, wait for its end, read the
    result; without the overhead stage's timing reads (its dispatch record and log).

    With `step_here` the caller sends the call itself, as the stream worker that streamed
    a model round sends its calls; otherwise a turn worker's step does.
    """
    return _noop_turn(step_here=step_here)[2]


def _noop_turn(*, step_here: bool = False) -> tuple[str, str, ToolResult]:
    """Start a turn of one no-op call, keep still, poll for its end: (turn, call, result).

    Each poll reads the turn's status and the call's result in one command (both are
    fields of the turn's state), as Celery's client reads its result in one GET.
    """
    from agentq import constants as k

    call = noop_call()
    store = runtime.get_store()
    turn_id = start_round([call], step_here=step_here)
    time.sleep(QUIET_WAIT_S)
    deadline = time.monotonic() + 30
    while True:
        status, raw = store.redis.hmget(k.turn_key(turn_id), "status", k.SETTLED + call.id)
        if status is not None and json.loads(status) in ("finished", "aborted", "error"):
            break
        if time.monotonic() > deadline:
            raise BenchError(f"noop turn {turn_id} did not end within 30 s")
        time.sleep(0.005)
    res = None if raw is None else ToolResult.model_validate_json(raw)
    if res is None or res.status != "ok":
        raise BenchError(f"noop settled {res and res.status}: {res and res.error}")
    return turn_id, call.id, res


def agentq_once(fx: BenchRig) -> float:
    """One no-op call as its turn sees it: from the step that sends it to the step that
    collects its result (the round's end), both timed in Redis by the turn's own steps.

    The client does not follow the turn's events: a follower wakes at each of them, and
    on two cores its wake-ups slowed the very call it timed (by about 0.5 ms a call). It
    keeps still, then looks for the turn's end every few milliseconds.
    """
    turn_id, call_id, _ = _noop_turn()
    store = runtime.get_store()
    sent_at = float(store.call_progress(turn_id)[1][call_id]["dispatched_at"])
    collected_at = store.bus.replay(turn_id)[-1].ts
    return collected_at - sent_at


def celery_once() -> float:
    from scripts.bench_celery_app import noop

    t0 = time.perf_counter()
    noop.delay().get(timeout=30)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- the stages


def bench_overhead(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    for _ in range(sz.warmup):
        agentq_once(fx)
        celery_once()
    a: list[float] = []
    c: list[float] = []
    sides: list[tuple[list[float], Callable[[], float]]] = [
        (a, lambda: agentq_once(fx)),
        (c, celery_once),
    ]
    block_ratios: list[float] = []
    # Alternating blocks, and which side goes first, so machine noise hits both.
    while len(a) < sz.overhead_calls:
        k = min(sz.block, sz.overhead_calls - len(a))
        for samples, once in sides:
            samples.extend(once() for _ in range(k))
        sides.reverse()
        block_ratios.append((pct(a[-k:], 50) or 0) / (pct(c[-k:], 50) or 1))
    out: dict[str, Any] = {**ms_stats("agentq_call_ms", a), **ms_stats("celery_call_ms", c)}
    out["overhead_ratio_p50"] = _ratio(out["agentq_call_ms_p50"], out["celery_call_ms_p50"])
    out["overhead_ratio_p99"] = _ratio(out["agentq_call_ms_p99"], out["celery_call_ms_p99"])
    # Each block's ratio compares calls made seconds apart: steadier on a busy machine.
    out["overhead_ratio_p50_paired"] = _r(pct(block_ratios, 50))
    out["overhead_samples"] = len(a)
    return out


def bench_throughput(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    from celery import group

    from scripts.bench_celery_app import noop

    n = sz.throughput_calls

    def agentq_round() -> float:
        calls = [ToolCall(id=f"c{i:05d}", name="noop", arguments="{}") for i in range(n)]
        t0 = time.perf_counter()
        _, results = run_round(calls, timeout_s=600)
        dt = time.perf_counter() - t0
        bad = Counter(r.status for r in results if r.status != "ok")
        if bad:
            raise BenchError(f"throughput round: not all ok: {dict(bad)}")
        return dt

    def celery_group() -> float:
        t0 = time.perf_counter()
        group(noop.s() for _ in range(n)).apply_async().join_native(timeout=600)
        return time.perf_counter() - t0

    a: list[float] = []
    c: list[float] = []
    for rep in range(sz.throughput_reps):
        if rep % 2 == 0:
            a.append(agentq_round())
            c.append(celery_group())
        else:
            c.append(celery_group())
            a.append(agentq_round())
    a_rate = n / (pct(a, 50) or 1)
    c_rate = n / (pct(c, 50) or 1)
    return {
        "agentq_calls_per_s": round(a_rate, 1),
        "celery_calls_per_s": round(c_rate, 1),
        "throughput_ratio": _ratio(a_rate, c_rate),
        "throughput_calls": n,
        "throughput_reps": sz.throughput_reps,
    }


def bench_timeout(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    over: list[float] = []
    for _ in range(sz.timeouts):
        call = ToolCall(
            id=f"c_{uuid.uuid4().hex[:12]}", name="bench_sleep", arguments='{"seconds": 5}'
        )
        turn_id, (res,) = run_round([call])
        # When the turn learned it: the step that collected the round.
        learned = runtime.get_store().bus.replay(turn_id)[-1].ts
        if res.status != "timeout" or res.record.started_at is None:
            raise BenchError(f"bench_sleep settled {res.status}, not timeout")
        over.append(learned - (res.record.started_at + 1.0))
    return {**ms_stats("timeout_overshoot_ms", over), "timeout_samples": len(over)}


class _ExitWatch(threading.Thread):
    """Records when a process exits, from a pidfd: no polling interval in the figure."""

    def __init__(self, pid: int, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.timeout_s = timeout_s
        self.gone_at: float | None = None
        self._fd = os.pidfd_open(pid)

    def run(self) -> None:
        try:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            if poller.poll(int(self.timeout_s * 1000)):
                self.gone_at = time.perf_counter()
        finally:
            os.close(self._fd)


def bench_abort(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    from agentq.api import Client

    client = Client()
    key = fx.script(Round(tool_calls=[ScriptedCall(name="hang", arguments={"seconds": 60})]))
    to_event: list[float] = []
    to_gone: list[float] = []
    for i in range(sz.aborts):
        handle = client._start_turn(f"{key} abort {i}")
        events = client.events(handle.turn_id, heartbeat_s=0.5)
        deadline = time.monotonic() + 30
        pid = None
        for ev in events:
            if time.monotonic() > deadline:
                raise BenchError("no tool_started for hang within 30 s")
            if ev is None:
                continue
            if ev.type in TERMINAL_TYPES:
                raise BenchError(f"abort turn ended early: {ev.type} {ev.fields}")
            if ev.type == "tool_started" and ev.fields.get("tool") == "hang":
                pid = int(ev.fields["pid"])
                break
        assert pid is not None
        watch = _ExitWatch(pid, timeout_s=30)
        watch.start()
        t0 = time.perf_counter()
        client.abort(handle.turn_id, handle.token)
        got = None
        for ev in events:
            if ev is not None and ev.type == "turn_aborted":
                got = time.perf_counter()
                break
            if time.monotonic() > deadline + 30:
                break
        with contextlib.suppress(Exception):
            events.close()  # type: ignore[attr-defined]
        watch.join(35)
        if got is None:
            raise BenchError("no turn_aborted event")
        to_event.append(got - t0)
        if watch.gone_at is None:
            raise BenchError(f"tool process {pid} still alive 30 s after the abort")
        to_gone.append(watch.gone_at - t0)
    return {
        **ms_stats("abort_to_event_ms", to_event),
        **ms_stats("abort_to_process_gone_ms", to_gone),
        "abort_samples": len(to_event),
    }


def redis_monitor(url: str, run: Callable[[], None]) -> list[tuple[str, str]]:
    """(client port or "lua", command) of everything Redis executed while `run` ran."""
    import redis as redis_py

    seen: list[tuple[str, str]] = []
    stop = threading.Event()

    def listen(mon: Any) -> None:
        with contextlib.suppress(Exception):
            while not stop.is_set():
                cmd = mon.next_command()
                seen.append(
                    (
                        str(cmd.get("client_port") or "lua"),
                        str(cmd.get("command", "")).split(" ")[0].upper(),
                    )
                )

    with redis_py.Redis.from_url(url).monitor() as mon:  # type: ignore[no-untyped-call]
        t = threading.Thread(target=listen, args=(mon,), daemon=True)
        t.start()
        time.sleep(0.2)
        seen.clear()
        run()
        stop.set()
        redis_py.Redis.from_url(url).ping()  # wakes the listener so it sees `stop`
        t.join(5)
    return list(seen)


def bench_watchdog(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """How late the stream worker's watchdog cuts a silent stream past its 500 ms limit, on
    the path the stream worker runs (`astream_round`): a stream gone silent after a chunk,
    and one that sends only SSE keep-alive comments after it (which must not count)."""
    import asyncio

    from agentq.errors import StreamIdleTimeout
    from agentq.llm.aclient import Attempt, astream_round, client_timeout, make_client

    assert fx.llm is not None
    llm = fx.llm
    out: dict[str, Any] = {}
    faults: tuple[tuple[str, Fault], ...] = (
        ("", "silent_after_chunks"),
        ("keepalive_", "keepalive_only"),
    )
    for label, fault in faults:
        key = fx.script(Round(text="hello", fault=fault, fault_after_chunks=1))

        async def overshoots(key: str = key) -> list[float]:
            client = make_client(
                base_url=llm.url, api_key=None, max_connections=8, timeout=client_timeout(5, 500)
            )
            over: list[float] = []
            try:
                for i in range(sz.watchdogs):
                    last = [0.0]

                    def on_delta(kind: str, text: str, last: list[float] = last) -> None:
                        last[0] = time.monotonic()

                    try:
                        attempt = Attempt(
                            client=client,
                            model="scripted",
                            idle_timeout_ms=500,
                            duration_left_s=30,
                            max_retries=0,
                            timeout=client_timeout(5, 500),
                            on_delta=on_delta,
                            on_retry=lambda *_: None,
                            abort=asyncio.Event(),
                            turn_id="bench",
                        )
                        prompt = [{"role": "user", "content": f"{key} {i}"}]
                        await astream_round(attempt, prompt, "[]")
                    except StreamIdleTimeout:
                        failed = time.monotonic()
                    else:
                        raise BenchError("the silent stream did not time out")
                    if not last[0]:
                        raise BenchError("no chunk arrived before the silence")
                    over.append(failed - (last[0] + 0.5))
            finally:
                await client.close()
            return over

        over = asyncio.run(overshoots())
        out.update(ms_stats(f"watchdog_{label}overshoot_ms", over))
        out[f"watchdog_{label}samples"] = len(over)
    return out


def publisher_main(turn_id: str, n: int, interval_ms: float) -> int:
    """The worker side of the event-latency stage, in its own process."""
    store = runtime.get_store()
    go = f"bench:go:{turn_id}"
    deadline = time.monotonic() + 30
    while not store.redis.exists(go):
        store.bus.publish(turn_id, "bench_warm")
        time.sleep(0.02)
        if time.monotonic() > deadline:
            return 1
    for i in range(n):
        store.bus.publish(turn_id, "bench_ping", i=i, sent_ns=time.monotonic_ns())
        time.sleep(interval_ms / 1000)
    store.bus.publish(turn_id, "turn_finished", reason="bench")
    return 0


def bench_events(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    store = runtime.get_store()
    turn_id = uuid.uuid4().hex
    token = secrets.token_urlsafe(16)
    store.create(
        turn_id,
        {"status": "bench", "token_sha256": hashlib.sha256(token.encode()).hexdigest()},
        [{"role": "user", "content": "bench"}],
    )
    bus_lat: list[float] = []
    sse_lat: list[float] = []
    warm = {"bus": threading.Event(), "sse": threading.Event()}
    errors: list[str] = []

    def on_ping(data: dict[str, Any], into: list[float]) -> None:
        if data.get("type") == "bench_ping":
            into.append((time.monotonic_ns() - int(data["sent_ns"])) / 1e9)

    def follow_bus() -> None:
        for ev in follow(store.bus, turn_id):
            if ev is None:
                continue
            if ev.type == "bench_warm":
                warm["bus"].set()
            on_ping({"type": ev.type, **ev.fields}, bus_lat)

    def follow_sse() -> None:
        import httpx

        url = f"{fx.gateway_url}/v1/turns/{turn_id}/events"
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        try:
            with httpx.stream("GET", url, headers=headers, timeout=30) as resp:
                if resp.status_code != 200:
                    errors.append(f"SSE answered {resp.status_code}")
                    warm["sse"].set()
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = json.loads(line[5:])
                    if data.get("type") == "bench_warm":
                        warm["sse"].set()
                    on_ping(data, sse_lat)
                    if data.get("type") in TERMINAL_TYPES:
                        return
        except Exception as exc:
            errors.append(f"SSE client: {type(exc).__name__}: {exc}")
            warm["sse"].set()

    threads = [threading.Thread(target=follow_bus, daemon=True)]
    if fx.gateway_url:
        threads.append(threading.Thread(target=follow_sse, daemon=True))
    else:
        warm["sse"].set()
    for t in threads:
        t.start()
    pub = start_process(
        [
            sys.executable,
            str(BENCH),
            "--publisher",
            turn_id,
            "--publish-n",
            str(sz.events),
            "--publish-interval-ms",
            "2",
        ],
        env=fx.env,
        cwd=ROOT,
        name="bench-publisher",
    )
    try:
        if not (warm["bus"].wait(30) and warm["sse"].wait(30)):
            raise BenchError("subscribers saw no warm-up event")
        store.redis.set(f"bench:go:{turn_id}", 1, ex=600)
        for t in threads:
            t.join(60 + sz.events * 0.01)
        pub.wait(30)
    finally:
        pub.stop()
        store.close(turn_id, TurnStatus.FINISHED, "turn_finished", {"reason": "bench"})
    out: dict[str, Any] = {**ms_stats("event_latency_ms", bus_lat), "event_samples": len(bus_lat)}
    if fx.gateway_url:
        out.update(ms_stats("sse_latency_ms", sse_lat))
        out["sse_samples"] = len(sse_lat)
        out["notes"] = errors
    else:
        out.update(
            {
                "sse_latency_ms_p50": None,
                "sse_latency_ms_p99": None,
                "notes": ["sse_latency: agentq.gateway is not importable yet; not measured"],
            }
        )
    return out


def bench_scale(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    from agentq import constants as k
    from agentq.api import Client

    client = Client()
    store = runtime.get_store()
    key = fx.script(
        Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 1})]),
        Round(text="slept."),
    )
    before = fx.memory_mb()
    pss_before = fx.memory_mb("pss")
    t0 = time.perf_counter()
    ids = [client._start_turn(f"{key} #{i}").turn_id for i in range(sz.scale_turns)]
    peak: dict[str, float] = {}
    pss_peak: dict[str, float] = {}
    polls = 0
    max_active = 0
    statuses: list[Any] = []
    budget_s = 60 + 3 * sz.scale_turns / max(fx.args.tool_concurrency, 1)
    while time.perf_counter() - t0 < budget_s:
        for kind, mb in fx.memory_mb().items():
            peak[kind] = max(peak.get(kind, 0.0), mb)
        if polls % 5 == 0:
            for kind, mb in fx.memory_mb("pss").items():
                pss_peak[kind] = max(pss_peak.get(kind, 0.0), mb)
        polls += 1
        max_active = max(max_active, int(store.redis.zcard(k.WAKEUPS)))
        statuses = turn_statuses(store, ids)
        if all(s in ("finished", "aborted", "error") for s in statuses):
            break
        time.sleep(0.2)
    took = time.perf_counter() - t0
    counts = Counter(str(s) for s in statuses)
    turns_mb = peak.get("turns", 0.0) - before.get("turns", 0.0)
    conc = fx.args.tool_concurrency
    return {
        "scale_turns": sz.scale_turns,
        "scale_all_settled": counts.get("finished") == len(ids),
        "scale_seconds": round(took, 2),
        "scale_statuses": dict(counts),
        # The tools alone need this long: N one-second sleeps on `conc` processes.
        "scale_floor_seconds": float(-(-sz.scale_turns // conc)),
        "scale_max_active": max_active,
        "scale_tool_concurrency": conc,
        "rss_mb": peak,
        "rss_mb_idle": before,
        "pss_mb": pss_peak,
        "pss_mb_idle": pss_before,
        "turn_worker_kb_per_turn": round(turns_mb * 1024 / max(sz.scale_turns, 1), 1),
    }
