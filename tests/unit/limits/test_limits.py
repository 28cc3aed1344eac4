"""The fleet-wide limits' scripts (agentq.limits), on fakeredis: pure Redis logic."""

from __future__ import annotations

import fakeredis

from agentq.limits.bucket import TokenBucket
from agentq.limits.semaphore import FOREVER, LeasedSemaphore
from agentq.local.processes import wait_for


def test_a_semaphore_holds_limit_places_and_a_holder_renews_its_own() -> None:
    sem = LeasedSemaphore(fakeredis.FakeRedis(), 2)
    assert sem.acquire("s", "a", 60) and sem.acquire("s", "b", 60)
    assert not sem.acquire("s", "c", 60)
    assert sem.acquire("s", "a", 60)  # renewed, not a third place
    sem.release("s", "b")
    assert sem.acquire("s", "c", 60)
    assert sorted(sem.holders("s")) == ["a", "c"]


def test_a_lapsed_lease_frees_its_place_and_an_ended_holder_is_dropped() -> None:
    sem = LeasedSemaphore(fakeredis.FakeRedis(), 1)
    assert sem.acquire("s", "dies", 2)  # long enough to outlast a loaded machine's next call
    assert not sem.acquire("s", "next", 60)
    wait_for(lambda: sem.acquire("s", "next", 60), 5, message="the lapsed lease never freed")
    sem2 = LeasedSemaphore(fakeredis.FakeRedis(), 1)
    assert sem2.acquire("t", "turn", FOREVER)
    assert not sem2.acquire("t", "r:1", 60)
    assert sem2.acquire("t", "r:1", 60, ["turn"])  # its owner found it ended
    assert sem2.holders("t") == ["r:1"]


def test_a_reservation_passes_its_place_to_the_turn_even_when_full() -> None:
    r = fakeredis.FakeRedis()
    sem = LeasedSemaphore(r, 1)
    assert sem.acquire("s", "r:1", 60)
    assert sem.acquire("s", "turn", FOREVER, ["r:1"])
    assert sem.holders("s") == ["turn"] and r.zscore("s", "turn") == float("inf")
    assert r.ttl("s") > 24 * 3600  # a place held for good keeps the set a week


def test_a_bucket_gives_its_burst_then_says_how_long_to_wait() -> None:
    bucket = TokenBucket(fakeredis.FakeRedis(), rate_per_s=2.0, burst=3)
    assert [bucket.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait_s = bucket.take("k")
    assert 0 < wait_s <= 0.5
    assert bucket.take("other") == 0.0  # one bucket per key


def test_a_bucket_spent_under_other_settings_owes_tokens_not_their_time() -> None:
    r = fakeredis.FakeRedis()
    # Rates slow enough that a loaded machine's seconds between two takes change nothing.
    slow = TokenBucket(r, rate_per_s=0.01, burst=2)
    assert [slow.take("k") for _ in range(2)] == [0.0, 0.0]
    assert slow.take("k") > 90  # the next token is 100 s away at this rate
    # Two tokens owed: a gateway with a burst of 50 has 48 left, not 200 s to wait.
    fast = TokenBucket(r, rate_per_s=0.2, burst=50)
    assert [fast.take("k") for _ in range(48)] == [0.0] * 48
    assert 0 < fast.take("k") <= 5
    # Spent here, at most an empty bucket is owed back at the slow rate: one token's wait.
    assert 90 < slow.take("k") <= 100
