"""One client's flood of starts must not starve another client's turn.

Before the per-key limits, 300 starts from one client in 3 s made another client's 2 s
turn take 51 s: every flood turn queued ahead of it on the tool worker. Now the flood
gets 429s past its burst and its running-turn cap, and the other client's turn takes at
most twice its time on an idle fleet. The figures are printed for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.config import load_settings
from agentq.errors import TurnNotFound
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.models import TERMINAL_STATUSES
from agentq.state.base import active_turns
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from tests.helpers import busy_factor, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(180)]

RIG_CONCURRENCY = {"tools": 8, "llm": 8, "turns": 32}
FLOOD_STARTS = 300
FLOOD_S = 3.0
FLOODER = "flood-" + secrets.token_urlsafe(24)
VICTIM = "victim-" + secrets.token_urlsafe(24)


def timed_turn(http: httpx.Client, client: Client, prompt: str) -> float:
    """Seconds from the start request to the turn's end."""
    t0 = time.monotonic()
    r = http.post(
        "/v1/turns",
        json={"prompt": prompt, "detach": True},
        headers={"Authorization": f"Bearer {VICTIM}"},
    )
    assert r.status_code == 202, r.text
    tid = r.json()["turn_id"]
    wait_for(
        lambda: client._store.status(tid) in TERMINAL_STATUSES,
        120,
        0.02,
        message="the victim's turn did not end",
    )
    took = time.monotonic() - t0
    assert client._store.status(tid) == "finished"
    return took


def test_a_flood_from_one_key_does_not_slow_another_keys_turn(rig: Any) -> None:
    settings = load_settings(
        api_keys=f"flooder={FLOODER},victim={VICTIM}",
        max_active_turns_per_key=4,
        start_rate_per_s=2.0,
        start_burst=4,
    )
    client = rig.client
    work = rig.script(Round(tool_calls=calls(("sleep", {"seconds": 2.0}))), Round(text="Done."))
    with (
        BackgroundServer(create_app(Client(settings))) as gw,
        httpx.Client(base_url=gw.url, timeout=30) as http,
    ):
        baseline_s = timed_turn(http, client, work)
        codes: list[int] = []

        def flood_one(i: int) -> None:
            time.sleep(max(0.0, i * FLOOD_S / FLOOD_STARTS - (time.monotonic() - t0)))
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                codes.append(
                    c.post(
                        "/v1/turns",
                        json={"prompt": work, "detach": True},
                        headers={"Authorization": f"Bearer {FLOODER}"},
                    ).status_code
                )

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=16) as pool:
            futures = [pool.submit(flood_one, i) for i in range(FLOOD_STARTS)]
            time.sleep(0.5)  # the flood is under way
            flooded_s = timed_turn(http, client, work)
            for f in futures:
                f.result()
        flood_wall_s = time.monotonic() - t0
    admitted = codes.count(202)
    print(
        f"\nflood: {FLOOD_STARTS} starts in {flood_wall_s:.1f}s: {admitted} admitted, "
        f"{codes.count(429)} refused (429); victim's turn {baseline_s:.2f}s alone, "
        f"{flooded_s:.2f}s during the flood ({flooded_s / baseline_s:.2f}x)"
    )
    assert codes.count(429) + admitted == FLOOD_STARTS
    assert admitted <= 4 + 2 * flood_wall_s + 1
    # Alone: 1.3-1.4x. Beside a four-process suite run the machine's load swings between
    # the two timings, so the bound grows with it.
    assert flooded_s <= 2 * baseline_s * busy_factor(), (baseline_s, flooded_s, busy_factor())
    for tid in active_turns(client._store.redis):
        if client._store.status(tid) not in TERMINAL_STATUSES:
            with contextlib.suppress(TurnNotFound):  # it may end on its own meanwhile
                client.abort(tid, None, operator=True)
