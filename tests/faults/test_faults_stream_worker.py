"""The stream worker SIGKILLed mid-stream: its heartbeat lapses, the turn sends the round
again to a new stream worker, and the model server is left with no orphan connection."""

from __future__ import annotations

import time

import pytest

from agentq.constants import PICKUP_LEASES
from agentq.local.processes import wait_for
from agentq.state.base import START_BACKSTOP_S
from agentq.testing.openai_server import Round
from tests.helpers import assert_gapless, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]

LEASE_S = 1.5
# 30 chunks of 150 ms: still streaming when the third delta is seen, on a loaded machine too.
TEXT = "The quick brown fox jumps over the lazy dog, twice over. " * 2


def _kill_mid_stream(rig) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    """Start a slowly streamed turn, SIGKILL the stream worker after three deltas."""
    key = rig.script(Round(text=TEXT, chunk_size=4, chunk_delay_ms=150), Round(text="unused"))
    tid = rig.client._start_turn(key).turn_id
    deltas = 0

    def streaming(e) -> bool:  # type: ignore[no-untyped-def]
        nonlocal deltas
        deltas += e.type == "llm_delta"
        return deltas >= 3

    rig.collect(tid, until=streaming)
    assert rig.llm.open_streams == 1
    rig.worker("llm").kill()
    killed_at = time.time()
    # The kernel closed the dead worker's socket: the server drops the stream.
    wait_for(lambda: rig.llm.open_streams == 0, 5, message="the orphaned stream to close")
    return tid, killed_at


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_killed_stream_worker_round_is_sent_again(make_rig, api: str) -> None:
    rig = make_rig(AGENTQ_LLM_API=api)
    rig.start("tools", "llm", "turns")
    tid, killed_at = _kill_mid_stream(rig)
    # The turn notices the lapsed heartbeat on its own and queues the round again.
    wait_for(
        lambda: any(e.type == "llm_retry" for e in rig.log_events(tid)),
        3 * LEASE_S + 2,
        interval_s=0.05,
        message="the turn to send the round again",
    )
    rig.start("llm")

    events = rig.collect(tid, timeout_s=40)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == TEXT
    retry = next(e for e in events if e.type == "llm_retry")
    assert retry.fields["code"] == "EWORKERLOST" and retry.fields["restart"] is True
    assert retry.ts - killed_at < 3 * LEASE_S + 2
    assert [e.type for e in events].count("llm_started") == 2
    assert [e.type for e in events].count("llm_finished") == 1
    assert_gapless(events)
    history = rig.client.get(tid)["history"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert {"input" in body for body in rig.llm.requests} == {api == "responses"}
    wait_for(lambda: rig.llm.open_streams == 0, 5, message="every stream to close")
    # The new worker serves the next turn as usual.
    again = rig.client._start_turn(rig.script(Round(text="fine")))
    assert rig.collect(again.turn_id)[-1].type == "turn_finished"


def test_killed_stream_worker_out_of_retries_fails_the_turn_clearly(make_rig) -> None:
    rig = make_rig(AGENTQ_LLM_MAX_RETRIES="0")
    rig.start("llm", "turns")
    tid, killed_at = _kill_mid_stream(rig)
    events = rig.collect(tid, timeout_s=20)
    assert events[-1].type == "turn_error", events[-1]
    assert events[-1].fields["code"] == "EWORKERLOST"
    assert "stream worker died mid-round" in events[-1].fields["error"]
    assert events[-1].ts - killed_at < 3 * LEASE_S + 2
    assert rig.client.get(tid)["state"]["status"] == "error"
    assert_gapless(events)


def test_a_round_whose_message_was_lost_is_sent_again(make_rig) -> None:
    # The second round is sent while no stream worker runs: its message waits in the
    # queue, where the test drops it, as a failover drops what the old master took.
    rig = make_rig()
    rig.start("tools", "llm", "turns")
    key = rig.script(
        Round(tool_calls=calls(("sleep", {"seconds": 1}))), Round(text="Answered after all.")
    )
    tid = rig.client._start_turn(key).turn_id
    rig.collect(tid, until=lambda e: e.type == "tool_started")
    rig.worker("llm").stop()
    redis = rig.client._store.redis
    wait_for(
        lambda: (
            redis.llen("agentq.llm") == 1 and rig.client.get(tid)["state"].get("llm_round") == 1
        ),
        30,
        message="the second round to be sent",
    )
    assert redis.delete("agentq.llm") == 1
    t0 = time.monotonic()
    rig.start("llm")
    events = rig.collect(tid, timeout_s=40)
    assert events[-1].type == "turn_finished", [e.type for e in events]
    assert events[-1].fields["content"] == "Answered after all."
    # Sent again after 4 leases (1.5 s each here), not at the round's deadline (minutes).
    assert time.monotonic() - t0 < 5 * PICKUP_LEASES * LEASE_S
    assert rig.client.get(tid)["state"]["llm_sends"] == 2
    assert_gapless(events)


def test_a_new_turns_lost_first_step_is_swept_up(make_rig) -> None:
    # No worker runs yet, and the test drops the new turn's first step from the turn
    # workers' queue: the wakeup stored with the turn starts it after all.
    rig = make_rig()
    handle = rig.client._start_turn(rig.script(Round(text="Started after all.")))
    redis = rig.client._store.redis
    wait_for(lambda: redis.llen("agentq.turns") == 1, 30, message="the first step to be sent")
    assert redis.delete("agentq.turns") == 1
    t0 = time.monotonic()
    rig.start("turns")
    rig.start("llm")
    events = rig.collect(handle.turn_id, timeout_s=START_BACKSTOP_S + 30)
    assert events[-1].type == "turn_finished", [e.type for e in events]
    assert events[-1].fields["content"] == "Started after all."
    assert time.monotonic() - t0 < START_BACKSTOP_S + 20
    assert_gapless(events)
