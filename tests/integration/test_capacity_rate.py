"""The admitted rate against a real redis-server: configured limits are a ceiling, a 429
cuts the rate fleet-wide at once and it climbs back, an unconfigured fleet learns the rate
from the provider's headers or its 429s, and no wall-clock second grants more than its
share.

Time is passed explicitly (`now_ms`); T0 falls on a whole second, as providers' windows do.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from agentq.llm.capacity import Capacity, Grant, Queued
from agentq.llm.capacity_rate import DECREASE, PROBE, RECOVER_S, SLOW_START, TOP_SHARE
from agentq.llm.headers import RateSignal, parse_rate_headers
from agentq.llm.limits import parse_limits
from agentq.local.redis_server import RedisServer

T0 = 1_700_000_000_000
BARE_429 = parse_rate_headers({"retry-after": "1"})


@pytest.fixture()
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def fleet(r: redis.Redis, spec: dict[str, Any], workers: int = 2) -> list[Capacity]:
    """`workers` processes' capacity managers of one fleet (one prefix), the same limits."""
    prefix = f"test:rate:{uuid.uuid4().hex[:8]}"
    limits = parse_limits(json.dumps(spec))
    return [Capacity(r, limits, prefix=prefix) for _ in range(workers)]


def grab(cap: Capacity, waiter: str, now_ms: int) -> Grant | Queued:
    return cap.acquire("m", waiter=waiter, owner="o", interactive=True, tokens=1, now_ms=now_ms)


def queued(res: Grant | Queued) -> Queued:
    assert isinstance(res, Queued), res
    return res


def admitted_rpm(cap: Capacity, now_ms: int) -> float | None:
    rpm: float | None = cap.snapshot("m", now_ms=now_ms)["admitted_rpm"]
    return rpm


def run(cap: Capacity, start_ms: int, seconds: float, every_ms: int = 5) -> list[int]:
    """Rounds asking all the time (one newcomer every `every_ms`) for `seconds`: when each
    was granted (ms since `start_ms`)."""
    at: list[int] = []
    waiting: list[str] = []
    for tick in range(int(seconds * 1000 / every_ms)):
        now = start_ms + tick * every_ms
        waiting.append(f"w{start_ms}-{tick}")
        for waiter in list(waiting):
            got = grab(cap, waiter, now)
            if isinstance(got, Queued):
                break  # the head waits: so does everyone behind it
            waiting.remove(waiter)
            at.append(now - start_ms)
    return at


def test_a_429_despite_pacing_cuts_the_rate_fleet_wide_and_it_climbs_back(r: redis.Redis) -> None:
    one, other = fleet(r, {"m": {"rpm": 1200}})
    assert admitted_rpm(other, T0) == 1200  # the configured limit, nothing cut yet
    # One worker's round is refused (the provider's window was fuller than pacing knew).
    one.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 300)
    cut = 1200 * DECREASE
    assert admitted_rpm(other, T0 + 300) == pytest.approx(cut)
    # The other 429s of that overfull window are the same signal: no second cut.
    other.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 400)
    assert admitted_rpm(one, T0 + 400) == pytest.approx(cut + 1200 * 0.2 / RECOVER_S * 0.1)
    # Additive increase, back to the configured ceiling and never past it.
    climb = 1200 * (1 - DECREASE) / RECOVER_S
    assert admitted_rpm(one, T0 + 1300) == pytest.approx(cut + climb)
    assert admitted_rpm(one, T0 + 300 + int(RECOVER_S * 1000)) == pytest.approx(1200)
    assert admitted_rpm(one, T0 + 60_000) == pytest.approx(1200)
    # A 429 a second later is news: cut again, from where the rate had climbed to.
    other.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 1300)
    assert admitted_rpm(one, T0 + 1300) == pytest.approx((cut + climb) * DECREASE)


def test_the_cut_rate_paces_every_worker(r: redis.Redis) -> None:
    one, other = fleet(r, {"m": {"rpm": 1200}})
    one.note_answer("m", "default", BARE_429, status=429, now_ms=T0 - 1)
    # The pause lasted a millisecond (to the next second); the fleet asks at 960 rpm now.
    at = run(other, T0, 1.0)
    assert 16 <= len(at) <= 17, at  # 960 rpm: 16 a second, climbing
    # One every 62.5 ms at first, a little less as the rate climbs (5 ms ticks).
    assert min(b - a for a, b in itertools.pairwise(at)) >= 55


def test_a_429_pauses_to_the_next_second_not_for_a_whole_retry_after(r: redis.Redis) -> None:
    (cap,) = fleet(r, {"m": {"rpm": 1200}}, workers=1)
    # retry-after: 1 is whole seconds rounded up; the provider's window opens on the second.
    assert cap.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 300) == T0 + 1000
    got = grab(cap, "a", T0 + 301)
    assert isinstance(got, Queued) and got.next_slot_ms == T0 + 1000
    assert isinstance(grab(cap, "a", T0 + 1000), Grant)
    # A wait longer than a second (a per-minute allowance spent) is meant as said.
    long_wait = parse_rate_headers({"retry-after": "20"})
    until = cap.note_answer("m", "default", long_wait, status=429, now_ms=T0 + 1500)
    assert until == T0 + 21_500
    # An unpaced model (nothing configured, nothing learned) keeps the provider's word.
    (bare,) = fleet(r, {}, workers=1)
    overloaded = RateSignal(pause_s=0.5)
    assert bare.note_answer("m", "default", overloaded, status=503, now_ms=T0) == T0 + 500


def test_an_unconfigured_fleet_learns_the_rate_from_headers_on_a_200(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, other = fleet(r, {})
    assert grab(one, "before", T0).lease_id == ""  # type: ignore[union-attr]
    headers = {
        "x-ratelimit-limit-requests": "1200",
        "x-ratelimit-remaining-requests": "1199",
        "x-ratelimit-reset-requests": "50ms",
        "x-ratelimit-limit-tokens": "600000",
    }
    assert one.note_answer("m", "default", parse_rate_headers(headers), now_ms=T0) is None
    snap = other.snapshot("m", now_ms=T0)
    assert snap["learned_rpm"] == 1200 and snap["learned_tpm"] == 600_000
    assert snap["admitted_rpm"] == 1200
    # Paced now, on the full path. The limit was idle, so the provider's second is clear:
    # a second's worth at once (one a tick), as a fleet that knew no limit would send...
    at = run(other, T0 + 1000, 2.0)
    assert [t for t in at if t < 1000] == list(range(0, 100, 5)), at
    # ...then the next second at the pace, one every 50 ms from its start.
    paced = [t for t in at if 1000 <= t < 2000]
    assert paced == list(range(1000, 2000, 50)), at
    # The same news again sends nothing to Redis: counted on this client, as the server's
    # own counts take in whatever else this test process's Redis is serving.
    sent: list[object] = []
    real = r.execute_command
    monkeypatch.setattr(r, "execute_command", lambda *a, **kw: sent.append(a[0]) or real(*a, **kw))
    one.note_answer("m", "default", parse_rate_headers(headers), now_ms=T0 + 2000)
    assert sent == []
    one.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 2000)
    assert sent == ["EVALSHA"]  # the count sees a note that does send


def test_an_unconfigured_fleet_without_headers_learns_from_its_429s(r: redis.Redis) -> None:
    (cap,) = fleet(r, {}, workers=1)
    # This process saw 20 rounds answered in the last second: 1,200 rpm.
    for _ in range(20):
        cap.report_success("m", "default", unleased=True)
    cap.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 200)
    assert admitted_rpm(cap, T0 + 200) == pytest.approx(1200 * DECREASE)
    # A guess may be far off: the rate grows half again each second (slow start)...
    assert admitted_rpm(cap, T0 + 1200) == pytest.approx(1200 * DECREASE * SLOW_START)
    # ...until a 429 comes while paced: the provider's limit is under that rate, and the
    # climb back ends under it too.
    refused_at = 1200 * DECREASE * SLOW_START
    cap.note_answer("m", "default", BARE_429, status=429, now_ms=T0 + 1200)
    assert admitted_rpm(cap, T0 + 1200) == pytest.approx(refused_at * DECREASE)
    top = refused_at * TOP_SHARE
    climb_s = (top - refused_at * DECREASE) / (top * (1 - DECREASE) / RECOVER_S)
    back = T0 + 1200 + round(climb_s * 1000)
    assert admitted_rpm(cap, back) == pytest.approx(top, rel=1e-3)
    # Past it only slowly (the limit may have grown), until the next 429.
    assert admitted_rpm(cap, back + 5000) == pytest.approx(top * (1 + PROBE * 5), rel=1e-3)


def test_no_second_grants_more_than_its_share(r: redis.Redis) -> None:
    (cap,) = fleet(r, {"m": {"rpm": 600}}, workers=1)  # 10 a second
    # An idle fleet, then rounds at 985 ms: GCRA has a second's worth ready (10), and so
    # has the second; the next second's share goes at the pace, not in a second burst.
    late = [grab(cap, f"a{i}", T0 + 985) for i in range(12)]
    assert [isinstance(g, Grant) for g in late] == [True] * 10 + [False] * 2
    # The two left over wait for the pace: one interval after the burst, and the next.
    assert [queued(g).next_slot_ms - T0 for g in late[10:]] == [1085, 1185]
    at = run(cap, T0 + 1000, 2.0)
    per_second = Counter((t + 1000) // 1000 for t in at)
    assert per_second[1] == 10 - 2 and per_second[2] == 10, per_second
    assert all(b - a >= 100 for a, b in itertools.pairwise([85, 185, *sorted(at)])), at
