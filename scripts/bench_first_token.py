"""The `first_token` stage: what a person at a screen waits for before the answer starts.

From `POST /v1/turns` to the first `llm_delta` on the turn's SSE stream (the gateway, the
turn worker's first step, the stream worker's claim, the model's first chunk, the event
bus), against the same request made directly with the `openai` SDK to the same scripted
server, from the request to its first chunk with text. The two sides alternate in blocks
whose order flips each time, so the machine's noise falls on both; each keeps one HTTP
client (one connection, reused) as a page and an SDK client would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from agentq.events import TERMINAL_TYPES
from agentq.testing.openai_server import Round
from scripts.bench_stages import BenchError, BenchRig, Sizes, ms_stats, pct

BLOCK = 10
"""Samples of one side in a row before the other side's turn."""
WARMUP = 10
"""Unmeasured samples of each side first: connections, imports, the workers' first rounds."""
START_INTERVAL_S = 0.11
"""At least this long between two turn starts: the gateway's default limit per caller is 10
a second (`AGENTQ_START_RATE_PER_S`), and a person at a screen starts fewer still."""
ANSWER = "The answer starts here, and it goes on for a few more chunks."
"""What the scripted model answers: the first chunk is what is timed."""


PHASES = ("answered", "turn_started", "llm_started", "llm_delta", "received")
"""Where a sample's time went, each ms from the POST: its 202, the events' own `ts` (when
the worker that published them made them), the first delta's arrival here."""


def _through_agentq(
    http: Any, key: str, phases: dict[str, list[float]], *, whole: bool = True
) -> float:
    """Seconds from the POST to the first `llm_delta` on the turn's SSE stream; reads on to
    the turn's end, as a page does, so no turn is left to abort on a disconnect (not
    `whole`: aborts the turn at its first delta instead, for answers that take seconds)."""
    t0, wall0 = time.perf_counter(), time.time()
    r = http.post("/v1/turns", json={"prompt": key})
    if r.status_code != 202:
        raise BenchError(f"POST /v1/turns answered {r.status_code}: {r.text[:200]}")
    at = {"answered": time.time() - wall0}
    handle = r.json()
    headers = {"Authorization": f"Bearer {handle['token']}", "Accept": "text/event-stream"}
    first: float | None = None
    with http.stream("GET", handle["events_url"], headers=headers) as resp:
        if resp.status_code != 200:
            raise BenchError(f"GET {handle['events_url']} answered {resp.status_code}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            type_ = event.get("type")
            if type_ in PHASES and type_ not in at:
                at[type_] = float(event["ts"]) - wall0
            if type_ == "llm_delta" and first is None:
                first = time.perf_counter() - t0
                at["received"] = time.time() - wall0
                if not whole:
                    http.post(f"/v1/turns/{handle['turn_id']}/abort", headers=headers)
                    break
            if type_ in TERMINAL_TYPES:
                break
    if first is None:
        raise BenchError(f"turn {handle['turn_id']} ended without an llm_delta")
    for name, s in at.items():
        phases.setdefault(name, []).append(s)
    return first


def _direct(client: Any, key: str, *, whole: bool = True) -> float:
    """Seconds from the SDK's request to its first chunk with text (reading on to the
    stream's end unless not `whole`)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": key}], stream=True
    )
    first: float | None = None
    with stream:
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
                if not whole:
                    break
    if first is None:
        raise BenchError("the direct stream had no text")
    return first


def bench_first_token(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    if not fx.gateway_url or fx.llm is None:
        return {"notes": ["first_token: the gateway did not start; not measured"]}
    key = fx.script(Round(text=ANSWER, chunk_size=8))
    sides, phases = first_tokens(fx, key, sz.first_token_samples, WARMUP)
    out: dict[str, Any] = {
        **ms_stats("first_token_agentq_ms", sides["agentq"]),
        **ms_stats("first_token_direct_ms", sides["direct"]),
        "first_token_samples": len(sides["agentq"]),
        "first_token_phase_ms_p50": {
            name: round((pct(phases[name], 50) or 0) * 1000, 1)
            for name in PHASES
            if phases.get(name)
        },
    }
    return {**out, **over_direct(sides, "first_token")}


def first_tokens(
    fx: BenchRig, key: str, samples: int, warmup: int, *, whole: bool = True
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`samples` first tokens of the script `key` on each side (s), in alternating blocks,
    after `warmup` unmeasured ones; and where agentq's time went."""
    import httpx
    import openai

    assert fx.gateway_url and fx.llm is not None
    sides: dict[str, list[float]] = {"agentq": [], "direct": []}
    phases: dict[str, list[float]] = {}
    with (
        httpx.Client(base_url=fx.gateway_url, timeout=30) as http,
        openai.OpenAI(base_url=fx.llm.url, api_key="bench", max_retries=0, timeout=30) as sdk,
    ):
        last_start = [0.0]

        def paced(i: int) -> float:
            time.sleep(max(0.0, last_start[0] + START_INTERVAL_S - time.perf_counter()))
            last_start[0] = time.perf_counter()
            return _through_agentq(http, f"{key} #{i}", phases, whole=whole)

        runs: dict[str, Callable[[int], float]] = {
            "agentq": paced,
            "direct": lambda i: _direct(sdk, f"{key} #{i}", whole=whole),
        }
        for i in range(warmup):
            for run in runs.values():
                run(i)
        phases.clear()
        order = ["agentq", "direct"]
        i = warmup
        while len(sides["agentq"]) < samples:
            for side in order:
                for _ in range(BLOCK):
                    sides[side].append(runs[side](i))
                    i += 1
            order.reverse()
    return sides, phases


def over_direct(sides: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """How much later agentq's first token came than the SDK's, ms, p50 and p99."""
    out: dict[str, float] = {}
    for q in (50, 99):
        a, d = pct(sides["agentq"], q), pct(sides["direct"], q)
        if a is not None and d is not None:
            out[f"{prefix}_over_direct_ms_p{q}"] = round((a - d) * 1000, 1)
    return out
