"""A stream worker's claim of a model round, on fakeredis: its lease is renewed from the
claim on, never before it, so the renewer cannot make a round look taken by another
delivery when it is this one's to stream."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest

from agentq import constants as k
from agentq.config import Settings
from agentq.llm import streams as streams_module
from agentq.llm.streams import Streams
from agentq.llm.task import claim_round
from agentq.models import LlmRoundRequest
from agentq.state.rounds import RoundBegun
from agentq.state.store import TurnStore


class _Host:
    def __init__(self) -> None:
        self.store = TurnStore(fakeredis.FakeRedis())
        self.settings = Settings()
        self.cancels = SimpleNamespace(on_watch=None)


@pytest.fixture()
def host(monkeypatch: pytest.MonkeyPatch) -> _Host:
    h = _Host()
    h.store.create("t1", {"status": "running"}, [{"role": "user", "content": "x"}])
    monkeypatch.setattr(streams_module, "_streams", Streams(h))  # type: ignore[arg-type]
    return h


def _renew_now(host: _Host) -> None:
    """What the renewer thread writes when it fires: the leases of the rounds held here."""
    streams = streams_module._streams
    assert streams is not None
    with streams._alive_lock:
        rounds = dict.fromkeys(streams.alive, streams.worker)
    host.store.llm_rounds_alive(rounds, streams.lease_ms)


def test_a_renewal_just_before_a_rounds_claim_does_not_refuse_it(
    host: _Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The renewer fires at the worst moment: after the Celery thread took the round's
    # message, before its claim reached Redis. It used to write this worker's lease for
    # the round first, and the claim then found the round "streaming elsewhere": nobody
    # streamed it until the turn's pickup, 40 s later.
    claim = host.store.begin_llm_round

    def renewer_first(*args: Any, **kwargs: Any) -> Any:
        _renew_now(host)
        return claim(*args, **kwargs)

    monkeypatch.setattr(host.store, "begin_llm_round", renewer_first)
    req = LlmRoundRequest(turn_id="t1", round_no=0, duration_left_s=60, idle_timeout_ms=1000)
    start = claim_round(host, req)  # type: ignore[arg-type]
    assert start is not None and start.outcome is RoundBegun.CLAIMED
    streams = streams_module._streams
    assert streams is not None and streams.alive[("t1", 0)] == 1  # renewed from now on
    lease = host.store.redis.hget(k.turn_key("t1"), k.LLM_ALIVE_FIELD)
    assert lease is not None and streams.worker in lease.decode()
    # A second delivery of the round while this one streams it is refused, and leaves
    # the first one's lease held.
    assert claim_round(host, req) is None  # type: ignore[arg-type]
    assert streams.alive[("t1", 0)] == 1


def test_capacity_leases_shorter_than_the_round_claim_are_renewed_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The renewer used to wake every third of AGENTQ_TURN_LEASE_S only: with capacity leases
    # of AGENTQ_LLM_LEASE_TTL_S = 1.5 s and claims of 30 s, it first renewed a lease after
    # 10 s, so every streaming round's stream slot lapsed and was given to another round.
    h = _Host()
    h.settings = Settings(turn_lease_s=30, llm_lease_ttl_s=1.5)
    streams = Streams(h)  # type: ignore[arg-type]
    renewed = threading.Event()
    monkeypatch.setattr(streams.capacity, "renew", lambda lease_id: renewed.set())
    streams.hold(("t1", 0), "lease-1")
    try:
        assert renewed.wait(5.0), "the capacity lease was not renewed within its ttl"
    finally:
        streams.release(("t1", 0))
