"""The model capacity stage of the benchmark (`capacity`): turns against a scripted
provider that admits 20 requests a second and answers 429 past that, in each of the
limiter shapes real providers have (`tests.rigs.ratelimit.SHAPES`: fixed wall-clock
windows or a continuously refilled bucket; rate-limit headers on every answer, only on
429s, or a bare `retry-after: 1`).

For each shape:
(a) `open`: nothing configured, on the rig's own workers: the fleet learns the rate
    from the answers; within 1.3x the floor, with at most 15% of requests refused.
(b) `limited`: every agentq worker restarted with `AGENTQ_LLM_LIMITS` at the provider's
    1,200 rpm (and the bench's client given it: its aborts take steps too): within 1.15x
    the floor, with at most 3% refused, and never slower than (a).
(c) `fair`, once, on the `window` shape: on the limited fleet, key "bulk" queues
    background turns, then key "alice" starts interactive ones: how long each of hers
    waits for its first round.

Each turn is two rounds: one `echo` call, then text. The floor is rounds / 20 s.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentq.errors import TurnNotFound
from agentq.events import TERMINAL_TYPES as TERMINAL
from agentq.fleet import runtime
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_stages import BenchRig, Sizes, pct, turn_statuses
from tests.rigs.ratelimit import SHAPES as PROVIDER_SHAPES

RPS = 20
"""The scripted provider's limit, in whole-second windows."""
ROUNDS = 2
ENDED = ("finished", "aborted", "error")
ABORT_CLIENTS = 16
AGENTQ_KINDS = ("tools", "turns", "llm", "io")


def _model() -> str:
    from agentq.config import load_settings

    return load_settings().llm_model


def _limits_json(model: str) -> str:
    return json.dumps({model: {"rpm": RPS * 60}})


def _clear_capacity(store: Any) -> int:
    """Forget every model's capacity state (queues, pauses, pacing) between sub-stages."""
    keys = list(store.redis.scan_iter(match="agentq:cap:*", count=1000))
    if keys:
        store.redis.delete(*keys)
    return len(keys)


SHAPES = tuple(PROVIDER_SHAPES)
"""Every shape, `window` (the limiter this stage had first) first."""
METRICS = (
    "capacity_window_open_floor_ratio",
    "capacity_window_open_refused_share",
    "capacity_window_limited_floor_ratio",
    "capacity_window_limited_refused_share",
    "capacity_window_bare_open_floor_ratio",
    "capacity_window_bare_open_refused_share",
    "capacity_window_bare_limited_floor_ratio",
    "capacity_window_bare_limited_refused_share",
    "capacity_bucket_open_floor_ratio",
    "capacity_bucket_open_refused_share",
    "capacity_bucket_limited_floor_ratio",
    "capacity_bucket_limited_refused_share",
    "capacity_bucket_refusals_open_floor_ratio",
    "capacity_bucket_refusals_open_refused_share",
    "capacity_bucket_refusals_limited_floor_ratio",
    "capacity_bucket_refusals_limited_refused_share",
    "capacity_limited_vs_open_worst",
    "capacity_not_finished",
)
"""What the stage reports per shape, spelled out: the goals and figures name them."""


def _prepare(fx: BenchRig, shape: str = "window") -> None:
    assert fx.llm is not None
    fx.llm.reset()
    fx.limits.requests_per_s = RPS
    fx.limits.set_shape(shape)
    _clear_capacity(runtime.get_store())
    gc.collect()


def _script(fx: BenchRig) -> str:
    return fx.script(
        Round(tool_calls=[ScriptedCall(name="echo", arguments={"text": "hi"})]),
        Round(text="done."),
    )


def _logs(store: Any, ids: list[str]) -> list[list[tuple[float, dict[str, Any]]]]:
    """Each turn's events as (epoch seconds, event) from its log, in one round trip."""
    from agentq import constants as k

    pipe = store.redis.pipeline(transaction=False)
    for tid in ids:
        pipe.xrange(k.turn_key(tid, "log"))
    out = []
    for entries in pipe.execute():
        evs = [(int(sid.split(b"-")[0]) / 1000, json.loads(f[b"e"])) for sid, f in entries]
        # When the process that published it made the event; its log position is later.
        out.append([(float(ev.get("ts") or at), ev) for at, ev in evs])
    return out


def _abort_all(client: Any, store: Any, handles: list[Any], budget_s: float = 60) -> int:
    """Abort every turn of `handles` still open; how many had not ended after `budget_s`."""
    ids = [h.turn_id for h in handles]
    open_ = [h for h, s in zip(handles, turn_statuses(store, ids), strict=True) if s not in ENDED]

    def abort(h: Any) -> None:
        with contextlib.suppress(TurnNotFound):  # it ended since we looked
            client.abort(h.turn_id, h.token)

    if open_:
        with ThreadPoolExecutor(ABORT_CLIENTS) as pool:
            list(pool.map(abort, open_))
    deadline = time.monotonic() + budget_s
    left = len(open_)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = sum(1 for s in turn_statuses(store, ids) if s not in ENDED)
    return left


@contextlib.contextmanager
def _workers_with(fx: BenchRig, env: dict[str, str]) -> Iterator[None]:
    """Every agentq worker of the rig swapped for one with `env`, put back after.

    All of them, not only the turn and stream workers: a tool or I/O worker that settles
    a turn's last call takes its next step itself, and so admits its next model round
    with the capacity limits of its own settings.
    """
    fleet = fx.local
    assert fleet is not None
    # As BenchRig starts them: the tool worker is the only one with options.
    opts: dict[str, dict[str, Any]] = {
        "tools": {"concurrency": fx.args.tool_concurrency, "extra_args": ("-Q", "agentq.tools")}
    }
    old = [(name, kind) for name, kind in fleet.kinds.items() if kind in AGENTQ_KINDS]

    def stop(names: list[str]) -> None:
        procs = [fleet.procs[n] for n in names if n in fleet.procs]
        with ThreadPoolExecutor(max(len(procs), 1)) as pool:
            list(pool.map(lambda p: p.stop(timeout_s=10), procs))
        for p in procs:
            fleet.retire(p)

    def start(named: list[tuple[str, str]], with_env: dict[str, str] | None) -> None:
        with ThreadPoolExecutor(max(len(named), 1)) as pool:
            futs = [
                # A loaded machine (other benches beside this one) takes longer than 30 s.
                pool.submit(
                    fleet.start_worker,
                    k_,
                    name=n,
                    env=with_env,
                    ready_timeout_s=120,
                    **opts.get(k_, {}),
                )
                for n, k_ in named
            ]
            for fut in futs:
                fut.result()

    stop([n for n, _ in old])
    new = [(f"bench-cap-{kind}-{fx.run_id}", kind) for _, kind in old]
    try:
        start(new, env)
        yield
    finally:
        stop([n for n, _ in new])
        start(old, None)


def _client(limits: str | None) -> Any:
    """A client with the fleet's limits: an abort takes the turn's step in this process,
    and the step withdraws the round from the queue, granting the next ones by the limits
    of this process's settings."""
    from agentq.api import Client
    from agentq.config import load_settings

    return Client(load_settings(llm_limits=limits) if limits else None)


def _run_turns(
    fx: BenchRig, n: int, prefix: str, limits: str | None, shape: str = "window"
) -> dict[str, Any]:
    """n detached turns at once against the 20 rps provider of `shape`, until all end or
    the budget."""
    from agentq import constants as k

    assert fx.llm is not None
    client = _client(limits)
    store = runtime.get_store()
    _prepare(fx, shape)
    key = _script(fx)
    floor = n * ROUNDS / RPS
    budget_s = 30 + 4 * floor
    since = time.time()
    handles = [client._start_turn(f"{key} #{i}", detach=True) for i in range(n)]
    started_s = time.time() - since
    ids = [h.turn_id for h in handles]
    # The turns still open, as the io stage counts them: one ZCARD of the open
    # turns, not n statuses a poll on the fleet's two cores.
    while time.time() - since < budget_s:
        time.sleep(0.1)
        if not store.redis.zcard(k.WAKEUPS):
            break
    ended = sum(1 for s in turn_statuses(store, ids) if s in ENDED)
    not_ended = _abort_all(client, store, handles) if ended < n else 0
    lim = fx.limits
    admitted, refused = len(lim.admitted_at), sum(lim.refused.values())
    counts = Counter(str(s) for s in turn_statuses(store, ids))
    types: Counter[str] = Counter()
    busy: list[float] = []
    last_end = since
    queued_pos: list[int] = []
    queued_wait: list[float] = []
    logs = _logs(store, ids)
    for log in logs:
        for ts, ev in log:
            types[ev["type"]] += 1
            if ev["type"] == "llm_finished" and ev.get("status") in (429, 503, 529):
                busy.append(ts)
            if ev["type"] == "llm_queued":
                queued_pos.append(int(ev.get("position") or 0))
                queued_wait.append(float(ev.get("wait_s") or 0))
            if ev["type"] in TERMINAL:
                last_end = max(last_end, ts)
    took = last_end - since
    finished = counts.get("finished", 0)
    return {
        f"{prefix}_turns": n,
        f"{prefix}_finished": finished,
        f"{prefix}_not_finished": n - finished,
        f"{prefix}_statuses": dict(counts),
        f"{prefix}_seconds": round(took, 2),
        f"{prefix}_floor_seconds": floor,
        f"{prefix}_floor_ratio": round(took / floor, 3),
        f"{prefix}_start_all_seconds": round(started_s, 2),
        f"{prefix}_requests_admitted": admitted,
        f"{prefix}_requests_refused": refused,
        f"{prefix}_refused_by_status": {str(k_): v for k_, v in lim.refused.items()},
        f"{prefix}_refused_share": round(refused / max(admitted + refused, 1), 4),
        f"{prefix}_most_in_one_second": lim.most_in_one_second(),
        f"{prefix}_busy_rounds_seen": len(busy),
        f"{prefix}_per_second": _per_second(since, last_end, lim.admitted_at, busy),
        f"{prefix}_llm_queued": types.get("llm_queued", 0),
        f"{prefix}_llm_queued_turns": sum(
            1 for log in logs if any(e["type"] == "llm_queued" for _, e in log)
        ),
        f"{prefix}_llm_queued_position_max": max(queued_pos, default=0),
        f"{prefix}_llm_queued_wait_s_max": max(queued_wait, default=0.0),
        f"{prefix}_llm_retries": types.get("llm_retry", 0),
        f"{prefix}_not_ended_after_abort": not_ended,
    }


def _per_second(
    since: float, until: float, admitted: list[float], refused: list[float]
) -> list[list[int]]:
    """[admitted, refused] in each of the provider's one-second windows of the run (a
    refusal timed by its round's `llm_finished`)."""
    first = int(since)
    out = [[0, 0] for _ in range(int(until) - first + 1)]
    for col, times in ((0, admitted), (1, refused)):
        for t in times:
            if 0 <= int(t) - first < len(out):
                out[int(t) - first][col] += 1
    return out


def _first_rounds(log: list[tuple[float, dict[str, Any]]]) -> tuple[float | None, float | None]:
    """When the turn's first round started (`llm_started`), and when its first round the
    provider admitted did (the `llm_started` before an `llm_finished` without an error)."""
    first = next((ts for ts, ev in log if ev["type"] == "llm_started"), None)
    started = None
    for ts, ev in log:
        if ev["type"] == "llm_started":
            started = ts
        elif ev["type"] == "llm_finished" and not ev.get("error"):
            return first, started
    return first, None


def _fairness(fx: BenchRig, sz: Sizes, model: str, limits: str) -> dict[str, Any]:
    from agentq.llm.capacity import Capacity
    from agentq.llm.limits import parse_limits
    from agentq.models import TurnRequest

    assert fx.llm is not None
    client = _client(limits)
    store = runtime.get_store()
    _prepare(fx)
    cap = Capacity(store.redis, parse_limits(limits))
    key = _script(fx)
    nb, ni = sz.capacity_bulk_turns, sz.capacity_interactive_turns
    bulk: list[Any] = []
    mine: list[Any] = []
    notes: list[str] = []
    out: dict[str, Any] = {"fair_bulk_turns": nb, "fair_interactive_turns": ni}
    try:
        t0 = time.time()
        for i in range(nb):
            req = TurnRequest(prompt=f"{key} bulk #{i}", detach=True)
            bulk.append(client._start_turn(req, owner="bulk"))
        out["fair_bulk_start_all_seconds"] = round(time.time() - t0, 2)
        # Her turns come once the backlog queues: the last bulk turn waits for its round.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(ev["type"] == "llm_queued" for _, ev in _logs(store, [bulk[-1].turn_id])[0]):
                break
            time.sleep(0.2)
        else:
            notes.append("capacity fair: the last bulk turn did not queue within 60 s")
        snap = cap.snapshot(model)
        out["fair_bulk_queued_at_start"] = snap["queued"]["background"]
        out["fair_bulk_rounds_admitted_before"] = len(fx.limits.admitted_at)
        asked: list[float] = []
        for i in range(ni):
            asked.append(time.time())
            mine.append(client._start_turn(TurnRequest(prompt=f"{key} alice #{i}"), owner="alice"))
        ids = [h.turn_id for h in mine]
        deadline = time.monotonic() + 60
        logs = _logs(store, ids)
        while time.monotonic() < deadline:
            logs = _logs(store, ids)
            if all(any(ev["type"] in TERMINAL for _, ev in log) for log in logs):
                break
            time.sleep(0.1)
        from_start: list[float] = []
        from_turn: list[float] = []
        to_turn: list[float] = []
        first_tries: list[float] = []
        queued_pos: list[int] = []
        for at, log in zip(asked, logs, strict=True):
            tried, served = _first_rounds(log)
            begun = next((ts for ts, ev in log if ev["type"] == "turn_started"), None)
            queued_pos += [
                int(ev.get("position") or 0) for _, ev in log if ev["type"] == "llm_queued"
            ]
            if tried is not None:
                first_tries.append(tried - at)
            if served is None or begun is None:
                continue
            from_start.append(served - at)
            from_turn.append(served - begun)
            to_turn.append(begun - at)
        counts = Counter(
            next((ev["type"] for _, ev in log if ev["type"] in TERMINAL), "open") for log in logs
        )
        out.update(
            {
                "fair_interactive_served": len(from_start),
                "fair_interactive_ends": dict(counts),
                "fair_first_round_s_p50": _r(pct(from_start, 50)),
                "fair_first_round_s_p99": _r(pct(from_start, 99)),
                "fair_first_round_s_max": _r(max(from_start, default=None)),
                "fair_from_turn_started_s_p50": _r(pct(from_turn, 50)),
                "fair_from_turn_started_s_p99": _r(pct(from_turn, 99)),
                # The turn worker's queue: her first step waits behind the bulk's steps.
                "fair_to_turn_started_s_p50": _r(pct(to_turn, 50)),
                "fair_to_turn_started_s_p99": _r(pct(to_turn, 99)),
                "fair_first_request_s_p99": _r(pct(first_tries, 99)),
                "fair_interactive_queued_position_max": max(queued_pos, default=0),
                "fair_interactive_busy_rounds": sum(
                    1
                    for log in logs
                    for _, ev in log
                    if ev["type"] == "llm_finished" and ev.get("status") in (429, 503, 529)
                ),
                "fair_bulk_queued_at_end": cap.snapshot(model)["queued"]["background"],
            }
        )
        if len(from_start) < ni:
            out["fair_first_round_s_p99"] = None  # a missing turn is a failed measurement
            notes.append(
                f"capacity fair: {ni - len(from_start)} of {ni} interactive turns never served"
            )
    finally:
        bulk_ended = sum(1 for s in turn_statuses(store, [h.turn_id for h in bulk]) if s in ENDED)
        out["fair_requests_refused_before_abort"] = sum(fx.limits.refused.values())
        out["fair_requests_admitted_before_abort"] = len(fx.limits.admitted_at)
        left = _abort_all(client, store, bulk + mine)
        out["fair_bulk_finished_before_abort"] = bulk_ended
        out["fair_not_ended_after_abort"] = left
        out["fair_requests_refused"] = sum(fx.limits.refused.values())
        out["fair_requests_admitted"] = len(fx.limits.admitted_at)
    out["notes"] = notes
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _shapes(fx: BenchRig) -> tuple[str, ...]:
    """The shapes this run measures (`--capacity-shapes`, default all)."""
    chosen = getattr(fx.args, "capacity_shapes", None)
    if not chosen:
        return SHAPES
    names = tuple(s.strip() for s in chosen.split(",") if s.strip())
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown capacity shapes {unknown}; known: {', '.join(SHAPES)}")
    return names


def bench_model_capacity(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """(a) nothing configured and (b) the limit configured, per shape; (c) fairness; see
    the module."""
    assert fx.llm is not None
    model = _model()
    n = sz.capacity_turns
    shapes = _shapes(fx)
    out: dict[str, Any] = {
        "capacity_model": model,
        "capacity_provider_rps": RPS,
        "capacity_shapes": list(shapes),
    }
    notes: list[str] = []

    def sub(name: str, run: Callable[[], dict[str, Any]]) -> None:
        """One sub-stage; its failure is a note, and the others still run."""
        try:
            got = run()
        except Exception as exc:
            notes.append(f"capacity {name}: failed: {type(exc).__name__}: {exc}")
            return
        notes.extend(got.pop("notes", []))
        out.update({f"capacity_{k_}": v for k_, v in got.items()})

    try:
        for shape in shapes:
            sub(f"{shape} open", functools.partial(_run_turns, fx, n, f"{shape}_open", None, shape))
        limits = _limits_json(model)
        try:
            with _workers_with(fx, {"AGENTQ_LLM_LIMITS": limits}):
                for shape in shapes:
                    sub(
                        f"{shape} limited",
                        functools.partial(_run_turns, fx, n, f"{shape}_limited", limits, shape),
                    )
                sub("fair", lambda: _fairness(fx, sz, model, limits))
        except Exception as exc:  # the fleet's restart: the open runs' figures stand
            notes.append(f"capacity limited: failed: {type(exc).__name__}: {exc}"[:2000])
    finally:
        fx.limits.requests_per_s = None
        fx.limits.set_shape("window")
        _clear_capacity(runtime.get_store())
    slower: list[float] = []
    not_finished = 0
    for shape in shapes:
        for mode in ("open", "limited"):
            prefix = f"capacity_{shape}_{mode}"
            not_finished += int(out.get(f"{prefix}_not_finished") or 0)
            if out.get(f"{prefix}_not_finished"):
                notes.append(
                    f"capacity {shape} {mode}: {out[f'{prefix}_statuses']} of {n} turns; "
                    f"{out[f'{prefix}_not_ended_after_abort']} still open after the abort"
                )
        opened = out.get(f"capacity_{shape}_open_seconds")
        limited = out.get(f"capacity_{shape}_limited_seconds")
        if opened and limited:
            out[f"capacity_{shape}_limited_vs_open"] = round(limited / opened, 3)
            slower.append(limited / opened)
    out["capacity_not_finished"] = not_finished
    if slower:
        out["capacity_limited_vs_open_worst"] = round(max(slower), 3)
    out["notes"] = notes
    return out
