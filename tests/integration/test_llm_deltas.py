"""A real stream worker's `llm_delta` events: every `AGENTQ_LLM_DELTA_INTERVAL_MS` (250 ms)
while someone follows the turn, every `AGENTQ_LLM_QUIET_DELTA_INTERVAL_MS` (2 s) while
nobody does, live again as soon as a follower comes; the text is whole either way."""

from __future__ import annotations

import itertools
import time

import pytest

from agentq.api import Client
from agentq.events import Event
from agentq.local.processes import wait_for
from agentq.testing.openai_server import Round
from tests.helpers import calls, script

pytestmark = pytest.mark.integration

TEXT = "".join(f"w{i:03d} " for i in range(100))
# 125 chunks over about 3 s: a dozen deltas at the watched interval, two at the quiet one.
STREAM = Round(text=TEXT, chunk_size=4, chunk_delay_ms=25)


def _deltas(events: list[Event], round_no: int) -> list[Event]:
    return [e for e in events if e.type == "llm_delta" and e.fields["round_no"] == round_no]


def test_an_unwatched_round_publishes_few_deltas_with_the_whole_text(
    fleet, llm_server, client: Client
) -> None:
    assert STREAM.chunk_count() > 100
    handle = client._start_turn(script(llm_server, STREAM))
    tid = handle.turn_id
    # Polled, not followed: a follower would count itself in `watchers`.
    wait_for(lambda: client._store.status(tid) == "finished", 30, message="the turn's end")
    log = client._store.bus.replay(tid)
    deltas = _deltas(log, 0)
    assert "".join(e.fields["text"] for e in deltas) == TEXT
    assert 1 <= len(deltas) <= 4, [e.ts for e in deltas]
    started = next(e for e in log if e.type == "llm_started")
    finished = next(e for e in log if e.type == "llm_finished")
    # An event's ts is when its batch went out. The round's claim publishes llm_started and
    # finds nobody following; its last deltas go with `llm_finished`; between them the
    # turn's deltas wait a quiet interval after its previous publish.
    went = [started.ts] + [d.ts for d in deltas]
    for before, d in zip(went, deltas, strict=False):
        if d.ts - started.ts < 0.05 or finished.ts - d.ts < 0.05:
            continue
        assert d.ts - before >= 1.8, [round(t - started.ts, 3) for t in went]


def test_a_watched_round_gets_deltas_at_the_normal_interval(
    fleet, llm_server, client: Client
) -> None:
    # The approval holds the turn until the follower is surely counted in: the streamed
    # round's first publish finds it watched.
    key = script(llm_server, Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))), STREAM)
    handle = client._start_turn(key)
    events: list[Event] = []
    for ev in client.events(handle.turn_id, heartbeat_s=0.5):
        if ev is None:
            continue
        events.append(ev)
        if ev.type == "interaction_requested":
            client.answer(handle.turn_id, ev.fields["request_id"], handle.token, "approve")
        if ev.type in ("turn_finished", "turn_error", "turn_aborted"):
            break
    assert events[-1].type == "turn_finished", events[-1]
    deltas = _deltas(events, 1)
    assert "".join(e.fields["text"] for e in deltas) == TEXT
    assert len(deltas) >= 6, [e.ts for e in deltas]
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(deltas)]
    assert max(gaps) < 1.5, gaps  # never a quiet interval's wait


def test_a_follower_that_comes_mid_round_gets_the_deltas_live_at_once(
    fleet, llm_server, client: Client
) -> None:
    # Six seconds of stream: held, its deltas would go 2 s after the claim, then 4 s.
    key = script(llm_server, Round(text=TEXT, chunk_size=4, chunk_delay_ms=50))
    tid = client._start_turn(key).turn_id
    wait_for(
        lambda: any(e.type == "llm_started" for e in client._store.bus.replay(tid)),
        30,
        interval_s=0.01,
        message="the round claimed, unwatched",
    )
    joined = time.time()
    first_live: float | None = None
    events: list[Event] = []
    for ev in client.events(tid, heartbeat_s=0.5):
        if ev is None:
            continue
        events.append(ev)
        if ev.type == "llm_delta" and first_live is None:
            first_live = time.time()
        if ev.type in ("turn_finished", "turn_error", "turn_aborted"):
            break
    assert events[-1].type == "turn_finished", events[-1]
    assert "".join(e.fields["text"] for e in _deltas(events, 0)) == TEXT
    assert first_live is not None
    # The follower's mark reached the stream worker (the watch channel): what it held went
    # out at once, not at the end of its quiet interval.
    assert first_live - joined < 1.2, first_live - joined
    assert len(_deltas(events, 0)) >= 6  # live from then on: the normal interval
