"""Model capacity across the fleet, against a scripted provider that rate-limits for real:
a busy provider fails no turn and uses up no retry, a configured limit holds for every
worker, an abort takes a queued round out at once, people at a screen go first and keys
share fairly, and a dead worker's stream slot comes back."""

from __future__ import annotations

import json
import time

import pytest

from agentq.config import load_settings
from agentq.events import Event
from agentq.llm.capacity import capacity_for
from agentq.local.processes import wait_for
from agentq.models import TurnRequest
from agentq.testing.openai_server import Round, ScriptedOpenAIServer
from tests.helpers import calls, wait_event
from tests.rigs.ratelimit import ProviderLimits

MODEL = "gpt-4o-mini"
"""The model the workers ask for (AGENTQ_LLM_MODEL's default); the scripted server answers any."""

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(180)]


def _first(events: list[Event], type_: str) -> Event:
    return next(e for e in events if e.type == type_)


def _one_stream_held(make_rig, until: str = "llm_started", **env: str):  # type: ignore[no-untyped-def]
    """A rig whose model allows one stream, and the turn that holds it, streaming slowly
    (about 4 s) and seen as far as `until`."""
    rig = make_rig(AGENTQ_LLM_LIMITS=json.dumps({MODEL: {"streams": 1}}), **env)
    rig.start("llm", "turns")
    slow = rig.script(Round(text="slowly " * 40, chunk_size=7, chunk_delay_ms=100))
    first = rig.client._start_turn(slow)
    wait_event(rig.client, first.turn_id, until)
    return rig, first


def test_a_busy_provider_fails_no_turn_and_uses_up_no_retry(make_rig) -> None:  # type: ignore[no-untyped-def]
    # No limit is configured, and no retry is allowed: 429s must still cost nothing.
    # A lapsed stream heartbeat would use one: the rig's 1.5 s lease is tight on a busy box.
    rig = make_rig(AGENTQ_LLM_MAX_RETRIES="0", AGENTQ_TURN_LEASE_S="5")
    rig.limits.requests_per_s = 4
    # Only `retry-after`: with rate headers on its 200s the fleet would pace from the
    # first answer, and the provider might never refuse.
    rig.limits.set_shape("window_bare")
    rig.start("tools", "llm", "turns")
    key = rig.script(Round(tool_calls=calls(("echo", {"text": "hi"}))), Round(text="all done"))
    handles = [rig.client._start_turn(key, detach=True) for _ in range(16)]
    events = {h.turn_id: rig.collect(h.turn_id, timeout_s=120) for h in handles}
    failed = [ev for ev in events.values() if ev[-1].type != "turn_finished"]
    assert not failed, [(e.type, e.fields.get("code")) for e in failed[0][-6:]]
    limits = rig.limits
    assert limits.refused[429] > 0, "the provider never refused: the test proves nothing"
    # The provider counts in whole-second windows: 4 at the end of one and 4 at the start
    # of the next are 8 within one second, and allowed.
    assert limits.most_in_one_second() <= 8
    assert len(limits.admitted_at) == 32
    queued = [e for ev in events.values() for e in ev if e.type == "llm_queued"]
    assert queued and all(e.fields["position"] >= 1 for e in queued)
    assert all("wait_s" in e.fields for e in queued)


def test_a_configured_limit_holds_for_every_worker(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(AGENTQ_LLM_LIMITS=json.dumps({MODEL: {"rpm": 240}}))
    rig.start("llm", "llm", "turns", "turns")
    key = rig.script(Round(text="paced"))
    started = time.monotonic()
    handles = [rig.client._start_turn(key) for _ in range(16)]
    for h in handles:
        assert rig.collect(h.turn_id, timeout_s=60)[-1].type == "turn_finished"
    limits = rig.limits
    # 240 rpm is 4 a second: a burst of 4, then one every 250 ms, so at most 8 grants in any
    # closed second. Arrivals at the server trail their grants, by a few hundred ms on a
    # loaded machine, which can bunch one more into a second; a limit each worker kept for
    # itself would let 16 through in the first second (two bursts of 4, twice the pace).
    assert limits.most_in_one_second() <= 10
    assert max(limits.admitted_at) - min(limits.admitted_at) >= 2.0
    assert time.monotonic() - started < 60
    assert not limits.refused


def test_an_abort_takes_a_queued_round_out_at_once(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig, first = _one_stream_held(make_rig)
    second = rig.client._start_turn(rig.script(Round(text="never streamed")))
    queued = wait_event(rig.client, second.turn_id, "llm_queued")
    assert queued.fields["position"] == 1
    cap = capacity_for(rig.client._store.redis, load_settings())
    assert cap.snapshot(MODEL)["queued"]["interactive"] == 1
    asked = time.monotonic()
    rig.client.abort(second.turn_id, second.token)
    events = rig.collect(second.turn_id, timeout_s=10)
    assert events[-1].type == "turn_aborted"
    assert time.monotonic() - asked < 5
    assert "llm_started" not in [e.type for e in events]
    assert cap.snapshot(MODEL)["queued"]["interactive"] == 0
    assert rig.collect(first.turn_id, timeout_s=30)[-1].type == "turn_finished"


def test_a_person_at_a_screen_goes_before_another_keys_backlog(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(AGENTQ_LLM_LIMITS=json.dumps({MODEL: {"rpm": 120}}))
    rig.start("llm", "turns")
    key = rig.script(Round(text="hello"))
    bulk = [
        rig.client._start_turn(TurnRequest(prompt=key, detach=True), owner="bulk")
        for _ in range(10)
    ]
    wait_event(rig.client, bulk[-1].turn_id, "llm_queued")
    alice = rig.client._start_turn(TurnRequest(prompt=key), owner="alice")
    mine = rig.collect(alice.turn_id, timeout_s=60)
    assert mine[-1].type == "turn_finished"
    theirs = [rig.collect(h.turn_id, timeout_s=60) for h in bulk]
    assert all(ev[-1].type == "turn_finished" for ev in theirs)
    served = _first(mine, "llm_started").ts
    after = [ev for ev in theirs if _first(ev, "llm_started").ts > served]
    # 120 rpm is one round every 500 ms: she waits about one interval, not the backlog.
    assert len(after) >= 5, [round(_first(ev, "llm_started").ts - served, 2) for ev in theirs]
    assert served - _first(mine, "turn_started").ts < 3.0


def test_a_dead_workers_stream_slot_comes_back(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig, first = _one_stream_held(make_rig, "llm_delta", AGENTQ_LLM_LEASE_TTL_S="2")
    rig.worker("llm").kill()
    wait_for(lambda: rig.llm.open_streams == 0, 5, message="the orphaned stream to close")
    # Nobody is left to give the slot back: the turn ends, the lease must lapse.
    rig.client.abort(first.turn_id, first.token)
    assert rig.collect(first.turn_id, timeout_s=20)[-1].type == "turn_aborted"
    rig.start("llm")
    second = rig.client._start_turn(rig.script(Round(text="my turn")))
    events = rig.collect(second.turn_id, timeout_s=60)
    assert events[-1].type == "turn_finished"
    assert events[-1].fields["content"] == "my turn"


def test_a_failing_deployment_is_skipped_for_the_next_one(make_rig) -> None:  # type: ignore[no-untyped-def]
    with ScriptedOpenAIServer() as healthy:
        rig = make_rig(
            AGENTQ_LLM_BREAKER_FAILURES="1",
            AGENTQ_LLM_LIMITS=json.dumps(
                {
                    MODEL: {
                        "strategy": "ordered",
                        "deployments": [
                            {"name": "first", "base_url": "PLACEHOLDER", "api_key": "sk-first-0"},
                            {"name": "second", "base_url": healthy.url, "api_key": "sk-second-0"},
                        ],
                    }
                }
            ).replace("PLACEHOLDER", "http://127.0.0.1:9/v1"),
        )
        # The first deployment refuses connections (nothing listens on port 9).
        rig.start("llm", "turns")
        key = rig.script(Round(text="unused"))
        healthy.set_script(key, [Round(text="from the second deployment")])
        first = rig.client._start_turn(key)
        events = rig.collect(first.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished"
        assert events[-1].fields["content"] == "from the second deployment"
        failover = [e for e in events if e.type == "llm_retry" and e.fields.get("failover")]
        assert len(failover) == 1 and "first" in failover[0].fields["error"]
        # The breaker is open now: the next turn goes straight to the second deployment.
        second = rig.client._start_turn(key)
        again = rig.collect(second.turn_id, timeout_s=60)
        assert again[-1].type == "turn_finished"
        assert not [e for e in again if e.type == "llm_retry"]
        assert len(healthy.requests) == 2
        # Keys never reach events or logs.
        text = json.dumps([e.fields for e in events + again]) + rig.logs()
        assert "sk-first-0" not in text and "sk-second-0" not in text


def test_a_round_that_waits_past_the_turns_limit_fails_it_clearly(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig, first = _one_stream_held(make_rig, AGENTQ_LLM_QUEUE_TIMEOUT_S="1")
    second = rig.client._start_turn(rig.script(Round(text="too late")))
    events = rig.collect(second.turn_id, timeout_s=30)
    end = events[-1]
    assert end.type == "turn_error" and end.fields["code"] == "ECAPACITY", end.fields
    assert end.fields["error_type"] == "ModelCapacityTimeout"
    assert "model capacity" in end.fields["error"]
    queued = _first(events, "llm_queued")
    assert 1.0 <= end.ts - queued.ts < 10
    cap = capacity_for(rig.client._store.redis, load_settings())
    assert cap.snapshot(MODEL)["queued"]["interactive"] == 0
    assert rig.collect(first.turn_id, timeout_s=30)[-1].type == "turn_finished"


def _share_refused(limits: ProviderLimits) -> float:
    refused = sum(limits.refused.values())
    return refused / max(refused + len(limits.admitted_at), 1)


def _run_paced_fleet(rig, turns: int = 24) -> list[list[Event]]:  # type: ignore[no-untyped-def]
    rig.start("tools", "llm", "turns")
    key = rig.script(Round(tool_calls=calls(("echo", {"text": "hi"}))), Round(text="all done"))
    handles = [rig.client._start_turn(key, detach=True) for _ in range(turns)]
    events = [rig.collect(h.turn_id, timeout_s=120) for h in handles]
    failed = [ev for ev in events if ev[-1].type != "turn_finished"]
    assert not failed, [(e.type, e.fields.get("code")) for e in failed[0][-6:]]
    assert len(rig.limits.admitted_at) == 2 * turns
    return events


def test_a_configured_limit_holds_against_a_provider_that_says_only_retry_after(make_rig) -> None:  # type: ignore[no-untyped-def]
    # The provider counts whole seconds and says nothing but `retry-after: 1`: the
    # configured rate paces, and a 429 cuts it rather than pausing the model a second.
    rig = make_rig(AGENTQ_LLM_LIMITS=json.dumps({MODEL: {"rpm": 240}}), AGENTQ_TURN_LEASE_S="5")
    rig.limits.requests_per_s = 4
    rig.limits.set_shape("window_bare")
    _run_paced_fleet(rig)
    assert _share_refused(rig.limits) <= 0.15, rig.limits.refused
    assert rig.limits.most_in_one_second() <= 8


def test_an_unconfigured_fleet_learns_the_rate_from_the_headers_of_its_429s(make_rig) -> None:  # type: ignore[no-untyped-def]
    # A continuously refilled bucket that sends its limits only with a 429: the first
    # turns go at once and some are refused; from then on the fleet paces at the limit.
    rig = make_rig(AGENTQ_TURN_LEASE_S="5")
    rig.limits.requests_per_s = 4
    rig.limits.set_shape("bucket_refusals")
    _run_paced_fleet(rig)
    cap = capacity_for(rig.client._store.redis, load_settings())
    assert cap.snapshot(MODEL)["learned_rpm"] == 240
    assert _share_refused(rig.limits) <= 0.45, rig.limits.refused
