"""The `waitpoints` stage: calls waiting on waitpoints by the thousand on one turn worker
and one Redis, what each costs while it waits, and how soon a completion settles its call.

N turns each make one call of `await_callback`, which ends its run with a Waitpoint. Once
every call waits (its `w:` record written), the stage reads the turn worker's RSS and
Redis's used memory against before, then completes two samples through the gateway
(`POST /v1/waitpoints/{id}`, one at a time, from a process of its own): one paced at a rate
the fleet keeps up with, one back to back. The POST answers after the settle script that
stores the result and publishes `tool_finished`, so its round trip is the completion to
`tool_finished` latency. The rest are completed from client threads, and the stage waits
for every turn's end.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from agentq import constants as k
from agentq.api import Client
from agentq.fleet import runtime
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_stages import BenchRig, Sizes, pct, turn_statuses

SAMPLE = 200
"""Completions timed through the gateway, one at a time, in each of the two samples."""
PACED_PER_S = 20.0
"""The paced sample's rate. Each completion's turn goes on (a step, a model round, its end)
on the cores the bench shares: back to back, completions wake turns faster than the fleet
ends them, and that sample times the CPU queue behind them too."""
CLIENT_THREADS = 16
WAIT_TIMEOUT_S = 3600


def _waiting(store: Any, turn_ids: list[str]) -> dict[str, str]:
    """turn id -> the call id of its open waitpoint, for the turns whose call waits now."""
    pipe = store.redis.pipeline(transaction=False)
    for tid in turn_ids:
        pipe.hscan(k.turn_key(tid), 0, match=k.WAITING + "*", count=1000)
    out: dict[str, str] = {}
    for tid, (_, fields) in zip(turn_ids, pipe.execute(), strict=True):
        for f in fields:
            out[tid] = (f.decode() if isinstance(f, bytes) else str(f))[len(k.WAITING) :]
    return out


def _timed_posts(url: str, addresses: list[tuple[str, str]], every_s: float) -> list[float]:
    """Complete each waitpoint through the gateway, one at a time, one every `every_s` (0:
    back to back): each POST's round trip, ms."""
    out: list[float] = []
    with httpx.Client(base_url=url) as http:
        # The connection opened and the route's first use paid before the clock runs: a
        # system that completes waitpoints keeps its connection, as this one does after.
        http.post(f"/v1/waitpoints/{addresses[0][0]}x", params={"token": "-"}, json={})
        start = time.perf_counter()
        for i, (wp_id, token) in enumerate(addresses):
            # An open-loop schedule: a late POST is sent at once, not pushed back further.
            time.sleep(max(0.0, start + i * every_s - time.perf_counter()))
            t = time.perf_counter()
            r = http.post(f"/v1/waitpoints/{wp_id}", params={"token": token}, json={"ok": 1})
            out.append((time.perf_counter() - t) * 1000)
            r.raise_for_status()
    return out


def bench_waitpoints(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    from agentq.gateway import create_app
    from agentq.testing.gateway import BackgroundServer

    client = Client()
    store = runtime.get_store()
    wps = store
    n = sz.waitpoint_calls
    key = fx.script(
        Round(tool_calls=[ScriptedCall(name="await_callback", arguments={"timeout_s": 3600})])
    )
    rss_before = fx.memory_mb().get("turns", 0.0)
    redis_before = int(store.redis.info("memory")["used_memory"])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        handles = list(pool.map(lambda i: client._start_turn(f"{key} #{i}"), range(n)))
    ids = [h.turn_id for h in handles]
    waiting: dict[str, str] = {}
    deadline = time.perf_counter() + 120 + n * 0.05
    while time.perf_counter() < deadline:
        waiting = _waiting(store, ids)
        if len(waiting) == n:
            break
        time.sleep(0.5)
    all_waiting_s = time.perf_counter() - t0
    rss_mb = fx.memory_mb().get("turns", 0.0) - rss_before
    redis_bytes = int(store.redis.info("memory")["used_memory"]) - redis_before
    addresses = [wps.waitpoint_address(t, c) for t, c in waiting.items()]
    # Timed from a process of its own, as an outside system completes them: this one runs the
    # scripted model's server, busy streaming the rounds of the turns the completions wake,
    # and a client sharing its interpreter would time that server's turns at the GIL too.
    # The fleet's own gateway process (`agentq serve`) answers.
    with contextlib.ExitStack() as stack:
        url = fx.gateway_url or stack.enter_context(BackgroundServer(create_app(client))).url
        spawn = multiprocessing.get_context("spawn")
        sample = min(SAMPLE, len(addresses) // 2)
        paced = [a[:2] for a in addresses[:sample]]
        burst = [a[:2] for a in addresses[sample : 2 * sample]]
        with spawn.Pool(1) as pool:
            latencies = pool.apply(_timed_posts, (url, paced, 1 / PACED_PER_S))
            back_to_back = pool.apply(_timed_posts, (url, burst, 0.0))
    t1 = time.perf_counter()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(
            pool.map(
                lambda a: client.complete_waitpoint(a[0], a[1], {"ok": 1}), addresses[2 * sample :]
            )
        )
    while time.perf_counter() - t1 < WAIT_TIMEOUT_S:
        statuses = turn_statuses(store, ids)
        if all(s in ("finished", "error", "aborted") for s in statuses):
            break
        time.sleep(0.5)
    finished = sum(1 for s in turn_statuses(store, ids) if s == "finished")
    return {
        "waitpoint_calls": n,
        "waitpoint_calls_waiting_at_once": len(waiting),
        "waitpoint_seconds_to_all_waiting": round(all_waiting_s, 2),
        "waitpoint_turn_worker_kb_per_call": round(rss_mb * 1024 / max(n, 1), 2),
        "waitpoint_redis_bytes_per_call": round(redis_bytes / max(n, 1)),
        "waitpoint_complete_ms_p50": round(pct(latencies, 50) or 0, 2),
        "waitpoint_complete_ms_p99": round(pct(latencies, 99) or 0, 2),
        "waitpoint_back_to_back_ms_p50": round(pct(back_to_back, 50) or 0, 2),
        "waitpoint_back_to_back_ms_p99": round(pct(back_to_back, 99) or 0, 2),
        "waitpoint_turns_finished": finished,
        "waitpoint_seconds_to_complete_rest": round(time.perf_counter() - t1, 2),
        "notes": [
            f"waitpoints: {len(waiting)} of {n} calls waiting at once on one default turn "
            f"worker; Redis's bytes per waiting call count the whole turn (state, history, "
            f"log); completions timed through the gateway from a process of their own, "
            f"{len(latencies)} at {PACED_PER_S:g}/s and {len(back_to_back)} back to back"
        ],
    }
