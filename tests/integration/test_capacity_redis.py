"""Fleet-wide model capacity against a real redis-server: pacing, tokens, stream leases,
queue order, withdraw, pauses, breakers, deployment choice, and many threads at once.

Time is passed explicitly (`now_ms`) except in the concurrency test, which uses Redis's clock.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from agentq.llm.capacity import Capacity, Grant, Queued, WakeAt, Wakes
from agentq.llm.headers import RateSignal, parse_rate_headers
from agentq.llm.limits import parse_limits
from agentq.local.redis_server import RedisServer

T0 = 1_700_000_000_000


@pytest.fixture()
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def make(r: redis.Redis, spec: dict[str, Any], **kw: Any) -> Capacity:
    """A Capacity under a prefix of its own, so tests share the server but no keys."""
    limits = parse_limits(json.dumps(spec))
    return Capacity(r, limits, prefix=f"test:cap:{uuid.uuid4().hex[:8]}", **kw)


def grab(
    cap: Capacity,
    waiter: str,
    now_ms: int,
    *,
    owner: str = "o",
    tokens: int = 1,
    interactive: bool = False,
    model: str = "m",
) -> Grant | Queued:
    return cap.acquire(
        model, waiter=waiter, owner=owner, interactive=interactive, tokens=tokens, now_ms=now_ms
    )


def granted(res: Grant | Queued) -> Grant:
    assert isinstance(res, Grant), res
    return res


def queued(res: Grant | Queued) -> Queued:
    assert isinstance(res, Queued), res
    return res


def busy(
    cap: Capacity, model: str, for_ms: int, now_ms: int | None = None, deployment: str = "default"
) -> int | None:
    """A busy answer (503) asking the fleet to wait `for_ms`: the model (or deployment) pauses."""
    signal = RateSignal(pause_s=for_ms / 1000)
    return cap.note_answer(model, deployment, signal, status=503, now_ms=now_ms)


def max_in_window(times: list[int], window_ms: int) -> int:
    """The most events in any half-open window [t, t + window_ms)."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window_ms:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_gcra_paces_1200_rpm_to_a_one_second_burst_then_one_every_50_ms(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 1200}})
    at: dict[str, int] = {}
    arrivals = []
    # 30 at once, then a newcomer every 10 ms for 3 s: five times the limit.
    for n, tick in enumerate([0] * 29 + list(range(300))):
        now = T0 + tick * 10
        waiter = f"w{n:04d}"
        arrivals.append(waiter)
        res = grab(cap, waiter, now)
        if isinstance(res, Grant):
            at[waiter] = now
        elif res.held:
            at[waiter] = res.next_slot_ms
        for other in res.woken:
            at[other] = now
        for slot in res.later:
            at[slot.waiter] = slot.at_ms  # a slot of its own, held for it
    times = sorted(t - T0 for t in at.values() if t < T0 + 3000)
    assert times.count(0) == 20  # the burst: one second's worth, not 1,200
    # Providers count in wall-clock seconds: the burst filled the first, so the pace
    # resumes as the next opens, 20 in each: no second burst, one every 50 ms from the
    # second's start, on the slots given ahead however late anyone asks.
    assert Counter(t // 1000 for t in times) == {0: 20, 1: 20, 2: 20}
    for second in (1000, 2000):
        paced = [t for t in times if second <= t < second + 1000]
        assert paced == list(range(second, second + 1000, 50))
    assert max_in_window(times, 1000) <= 20
    # One owner's rounds are served in arrival order.
    assert sorted(at, key=lambda w: (at[w], w)) == arrivals[: len(at)]


def test_a_slot_given_ahead_is_held_however_late_its_turn_asks(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 600}}, burst_s=0)  # one every 100 ms
    granted(grab(cap, "a", T0))
    b = queued(grab(cap, "b", T0 + 10))
    assert (b.held, b.next_slot_ms, b.retry_at_ms) == (True, T0 + 100, T0 + 100)
    # Asked early, the slot stays where it was; asked late, it is still b's...
    assert queued(grab(cap, "b", T0 + 50)).retry_at_ms == T0 + 100
    late = granted(grab(cap, "b", T0 + 180))
    assert late.granted_at_ms == T0 + 100
    # ...and the pace went on from the slot, not from the late ask: c's slot is at 200.
    c = grab(cap, "c", T0 + 181)
    assert queued(c).next_slot_ms == T0 + 200


def test_tokens_are_estimated_up_front_and_corrected_from_real_usage(r: redis.Redis) -> None:
    cap = make(r, {"m": {"tpm": 6000}})  # 100 tokens/s: 10 ms a token, 990 ms burst room
    a = granted(grab(cap, "a", T0, tokens=1000))
    b = queued(grab(cap, "b", T0, tokens=100))
    assert b.next_slot_ms == T0 + 10_000 - 990
    # a used 100 of the 1,000 it reserved: 900 tokens (9 s) come back, b goes at once.
    wakes = cap.release(a.lease_id, tokens_used=100, now_ms=T0 + 10)
    assert wakes.woken == ("b",)
    b_grant = granted(grab(cap, "b", T0 + 10))
    assert b_grant.tokens == 100
    # b used 3,000, not 100: the 2,900 more push the next request 29 s further out.
    cap.release(b_grant.lease_id, tokens_used=3000, now_ms=T0 + 20)
    c = queued(grab(cap, "c", T0 + 20, tokens=10))
    assert c.next_slot_ms == T0 + 2000 + 29_000 - 990
    snap = cap.snapshot("m", now_ms=T0 + 20)
    assert snap["tokens_last_minute"] == 100 + 3000
    assert snap["requests_last_minute"] == 2


def test_stream_slots_are_leases_and_a_dead_workers_lease_comes_back(r: redis.Redis) -> None:
    cap = make(r, {"m": {"streams": 2}}, lease_ttl_ms=10_000, grant_ttl_ms=5_000)
    a = granted(grab(cap, "a", T0))
    b = granted(grab(cap, "b", T0))
    c = queued(grab(cap, "c", T0))
    assert c.position == 1 and c.next_slot_ms == T0 + 10_000  # backstop: a lease's expiry
    assert cap.snapshot("m", now_ms=T0)["streams_in_use"] == 2
    # a's worker releases: the slot goes to the head of the queue, whose turn must be woken.
    assert cap.release(a.lease_id, now_ms=T0 + 100).woken == ("c",)
    c_grant = granted(grab(cap, "c", T0 + 200))
    assert c_grant.granted_at_ms == T0 + 100
    # c's worker renews its lease; b's worker died and never does.
    assert cap.renew(c_grant.lease_id, now_ms=T0 + 9_000)
    d = queued(grab(cap, "d", T0 + 9_500))
    assert d.next_slot_ms == T0 + 10_000
    got = granted(grab(cap, "d", T0 + 10_001))
    assert got.lease_id not in (b.lease_id, c_grant.lease_id)
    assert not cap.renew(b.lease_id, now_ms=T0 + 10_002)  # b's worker learns its slot is gone
    assert cap.snapshot("m", now_ms=T0 + 10_002)["streams_in_use"] == 2  # c and d
    # A late release frees nothing twice.
    assert cap.release(b.lease_id, now_ms=T0 + 10_003).woken == ()
    assert cap.snapshot("m", now_ms=T0 + 10_003)["streams_in_use"] == 2


def test_interactive_goes_first_and_a_big_backlog_does_not_delay_another_owner(
    r: redis.Redis,
) -> None:
    cap = make(r, {"m": {"rpm": 60}})  # one request a second
    granted(grab(cap, "A:0", T0, owner="A"))
    for i in range(1, 501):
        assert queued(grab(cap, f"A:{i:03d}", T0 + 1, owner="A")).position == i
    b = queued(grab(cap, "B:chat", T0 + 500, owner="B", interactive=True))
    # The head asks a little before its slot, to be given it on time.
    assert b.position == 1 and b.next_slot_ms == T0 + 1000 and b.retry_at_ms == T0 + 800
    assert queued(grab(cap, "A:001", T0 + 600, owner="A")).position == 2
    # The next slot, whoever takes the step: B's round is granted in it.
    res = queued(grab(cap, "A:001", T0 + 1000, owner="A"))
    assert res.woken == ("B:chat",) and res.position == 1
    assert granted(grab(cap, "B:chat", T0 + 1001, owner="B")).granted_at_ms == T0 + 1000
    # Background: C's first round starts level with A's next (both first of their owner
    # in the queue), not behind A's 499.
    c = queued(grab(cap, "C:bg", T0 + 1100, owner="C"))
    assert c.position == 2
    assert granted(grab(cap, "A:001", T0 + 2000, owner="A")).granted_at_ms == T0 + 2000
    assert queued(grab(cap, "A:002", T0 + 3000, owner="A")).woken == ("C:bg",)
    snap = cap.snapshot("m", now_ms=T0 + 3000)
    assert snap["queued"] == {"interactive": 0, "background": 499}


def test_owners_take_turns_by_weight_and_each_keeps_its_order(r: redis.Redis) -> None:
    # Unpaced: everyone queues behind a pause, then one call serves all.
    cap = make(r, {"m": {"streams": 100}}, owner_weights={"heavy": 2})
    busy(cap, "m", 1000, now_ms=T0)
    for i in range(1, 5):
        queued(grab(cap, f"heavy:{i}", T0 + i, owner="heavy"))
    for i in range(1, 5):
        queued(grab(cap, f"light:{i}", T0 + 10 + i, owner="light"))
    queued(grab(cap, "chat:1", T0 + 20, owner="light", interactive=True))
    res = granted(grab(cap, "new:1", T0 + 1000, owner="new"))
    # Woken lists grants in the order given: interactive first, then by start tag
    # (heavy 0, .5, 1, 1.5; light 0, 1, 2, 3; new 0), ties by waiter id.
    assert res.woken == (
        "chat:1",
        "heavy:1",
        "light:1",
        # new:1, the caller, was granted here
        "heavy:2",
        "heavy:3",
        "light:2",
        "heavy:4",
        "light:3",
        "light:4",
    )


def test_class_weights_let_background_through_while_interactive_waits(r: redis.Redis) -> None:
    cap = make(r, {"m": {"streams": 100}}, background_every=3)
    busy(cap, "m", 1000, now_ms=T0)
    for i in range(1, 7):
        queued(grab(cap, f"i:{i}", T0 + i, interactive=True))
        queued(grab(cap, f"b:{i}", T0 + i))
    res = granted(grab(cap, "b:1", T0 + 1000))
    # Two interactive grants, then one background (b:1, the caller), and so on.
    assert res.woken == (
        "i:1",
        "i:2",
        "i:3",
        "i:4",
        "b:2",
        "i:5",
        "i:6",
        "b:3",
        "b:4",
        "b:5",
        "b:6",
    )


def test_withdraw_leaves_the_queue_and_gives_back_an_untaken_grant(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 60}})
    granted(grab(cap, "a", T0))
    queued(grab(cap, "b", T0))
    queued(grab(cap, "c", T0))
    queued(grab(cap, "d", T0))
    assert queued(grab(cap, "d", T0 + 1)).position == 3
    cap.withdraw("m", "c", now_ms=T0 + 2)
    assert queued(grab(cap, "d", T0 + 3)).position == 2
    cap.withdraw("m", "c", now_ms=T0 + 4)  # again: nothing to take out
    assert queued(grab(cap, "d", T0 + 5)).position == 2
    # b is granted by d's call but its turn is aborted before it takes the grant: the
    # request was never sent, so the slot comes back and d takes it in the same call.
    assert queued(grab(cap, "d", T0 + 1000)).woken == ("b",)
    assert cap.withdraw("m", "b", now_ms=T0 + 1001).woken == ("d",)
    assert cap.snapshot("m", now_ms=T0 + 1001)["requests_last_minute"] == 2  # a and d
    assert queued(grab(cap, "b", T0 + 1002)).position == 1  # b asks again: a new round
    # A grant already taken is the stream worker's to release, not withdraw's.
    d = granted(grab(cap, "d", T0 + 1003))
    cap.withdraw("m", "d", now_ms=T0 + 1004)
    assert cap.renew(d.lease_id, now_ms=T0 + 1005)


def test_a_429_pauses_the_deployment_for_the_whole_fleet(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 600}})
    other_worker = Capacity(r, cap.limits, prefix=cap.prefix)
    signal = parse_rate_headers({"retry-after": "5"})
    assert cap.note_answer("m", "default", signal, status=429, now_ms=T0) == T0 + 5000
    res = queued(grab(other_worker, "a", T0 + 10))
    assert res.next_slot_ms == T0 + 5000
    assert busy(cap, "m", 2000, now_ms=T0) == T0 + 5000  # only lengthens
    assert cap.snapshot("m", now_ms=T0)["paused_until_ms"] == T0 + 5000
    assert granted(grab(other_worker, "a", T0 + 5000)).granted_at_ms == T0 + 5000
    # An exhausted allowance pauses until its reset; a healthy one does not pause.
    empty = RateSignal(remaining_requests=0, reset_requests_s=2.0, remaining_tokens=500)
    assert cap.note_answer("m", "default", empty, now_ms=T0 + 6000) == T0 + 8000
    assert cap.note_answer("m", "default", RateSignal(remaining_requests=3)) is None
    # A busy answer of the model's own endpoint pauses the model: every deployment.
    assert busy(cap, "m", 1000, now_ms=T0 + 9000) == T0 + 10_000
    assert queued(grab(cap, "b", T0 + 9001)).next_slot_ms == T0 + 10_000
    assert cap.snapshot("m", now_ms=T0 + 9001)["paused_until_ms"] == T0 + 10_000


def two(strategy: str, **a: Any) -> dict[str, Any]:
    deps = [{"name": "a", **a}, {"name": "b", "streams": 4}]
    return {"m": {"streams": 100, "strategy": strategy, "deployments": deps}}


def test_breaker_opens_after_n_failures_then_half_opens_with_one_probe(r: redis.Redis) -> None:
    cap = make(r, two("ordered"), breaker_failures=3, breaker_cooldown_ms=10_000)
    assert granted(grab(cap, "x1", T0)).deployment == "a"
    assert cap.report_failure("m", "a", "5xx", now_ms=T0) == "closed"
    assert cap.report_failure("m", "a", "stall", now_ms=T0) == "closed"
    assert cap.report_failure("m", "a", "connection", now_ms=T0 + 1) == "open"
    assert granted(grab(cap, "x2", T0 + 2)).deployment == "b"
    assert cap.report_failure("m", "a", "5xx", now_ms=T0 + 3) == "open"  # in flight before
    snap = cap.snapshot("m", now_ms=T0 + 3)["deployments"]["a"]
    assert snap["breaker"] == "open" and snap["open_until_ms"] == T0 + 10_001
    assert snap["last_failure"] == "5xx" and snap["failures"] == 4
    # Cool-down over: one request probes a, the next goes to b while the probe runs.
    probe = granted(grab(cap, "x3", T0 + 10_001))
    assert probe.deployment == "a"
    assert granted(grab(cap, "x4", T0 + 10_002)).deployment == "b"
    assert cap.snapshot("m", now_ms=T0 + 10_002)["deployments"]["a"]["breaker"] == "probing"
    # The probe fails: open again for a whole cool-down.
    assert cap.report_failure("m", "a", "5xx", now_ms=T0 + 10_003) == "open"
    cap.release(probe.lease_id, now_ms=T0 + 10_004)
    assert granted(grab(cap, "x5", T0 + 19_000)).deployment == "b"
    probe = granted(grab(cap, "x6", T0 + 20_003))
    assert probe.deployment == "a"
    cap.report_success("m", "a")
    assert granted(grab(cap, "x7", T0 + 20_005)).deployment == "a"
    assert cap.snapshot("m", now_ms=T0 + 20_005)["deployments"]["a"]["failures"] == 0


def test_a_probe_whose_worker_died_lets_another_request_probe(r: redis.Redis) -> None:
    cap = make(r, two("ordered"), breaker_failures=1, breaker_cooldown_ms=1000, lease_ttl_ms=5000)
    cap.report_failure("m", "a", "5xx", now_ms=T0)
    assert granted(grab(cap, "p1", T0 + 1000)).deployment == "a"  # the probe; never reports
    assert granted(grab(cap, "p2", T0 + 2000)).deployment == "b"
    assert granted(grab(cap, "p3", T0 + 6001)).deployment == "a"  # its lease expired


def test_all_deployments_down_queues_until_the_first_comes_back(r: redis.Redis) -> None:
    cap = make(r, two("ordered"), breaker_failures=1, breaker_cooldown_ms=4000)
    cap.report_failure("m", "a", "5xx", now_ms=T0)
    cap.report_failure("m", "b", "5xx", now_ms=T0 + 1000)
    assert queued(grab(cap, "x", T0 + 1500)).next_slot_ms == T0 + 4000
    assert granted(grab(cap, "x", T0 + 4000)).deployment == "a"


def test_ordered_fills_the_first_deployment_least_loaded_spreads(r: redis.Redis) -> None:
    ordered = make(r, two("ordered", streams=2))
    picks = [granted(grab(ordered, f"o{i}", T0)).deployment for i in range(6)]
    assert picks == ["a", "a", "b", "b", "b", "b"]
    assert queued(grab(ordered, "o6", T0)).position == 1  # both full
    spread = make(r, two("least_loaded", streams=2))
    picks = [granted(grab(spread, f"l{i}", T0)).deployment for i in range(6)]
    # By share of each one's streams in use (a: 2, b: 4), ties to the first listed.
    assert picks == ["a", "b", "b", "a", "b", "b"]
    snap = spread.snapshot("m", now_ms=T0)["deployments"]
    assert (snap["a"]["streams_in_use"], snap["b"]["streams_in_use"]) == (2, 4)


def test_deployment_rpm_limits_move_traffic_to_the_next(r: redis.Redis) -> None:
    cap = make(r, {"m": {"deployments": [{"name": "a", "rpm": 60}, {"name": "b", "rpm": 60}]}})
    picks = [granted(grab(cap, f"w{i}", T0)).deployment for i in range(2)]
    assert picks == ["a", "b"]
    assert queued(grab(cap, "w2", T0)).next_slot_ms == T0 + 1000


def test_the_head_of_the_queue_is_named_with_the_time_of_its_slot(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 60}})
    a = granted(grab(cap, "a", T0))
    assert queued(grab(cap, "b", T0)).wake_next is None  # b is the head itself
    # Woken a little before its slot, to be given it on time.
    assert queued(grab(cap, "c", T0)).wake_next == WakeAt(waiter="b", at_ms=T0 + 800)
    wakes = cap.release(a.lease_id, now_ms=T0 + 1000)
    assert wakes.woken == ("b",) and wakes.wake_next == WakeAt(waiter="c", at_ms=T0 + 1800)
    # c asks then, and holds its slot: the slot is c's, however late c takes it.
    held = queued(grab(cap, "c", T0 + 1800))
    assert held.held and held.retry_at_ms == T0 + 2000
    assert granted(grab(cap, "c", T0 + 2150)).granted_at_ms == T0 + 2000


def test_acquire_is_idempotent_per_waiter(r: redis.Redis) -> None:
    cap = make(r, {"m": {"streams": 5}})
    first = granted(grab(cap, "w", T0))
    again = granted(grab(cap, "w", T0 + 5))
    assert again.lease_id == first.lease_id and again.granted_at_ms == T0
    assert cap.snapshot("m", now_ms=T0 + 5)["streams_in_use"] == 1
    cap.release(first.lease_id, now_ms=T0 + 6)
    assert granted(grab(cap, "w", T0 + 7)).lease_id != first.lease_id  # a new round


def test_a_waiter_whose_turn_stopped_asking_is_dropped(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 60}}, waiter_ttl_ms=30_000)
    granted(grab(cap, "a", T0))
    ghost = queued(grab(cap, "ghost", T0))
    assert ghost.retry_at_ms == T0 + 800
    late = queued(grab(cap, "late", T0 + 1))
    assert late.retry_at_ms <= T0 + 1 + 10_000  # a live waiter asks at least every ttl/3
    res = granted(grab(cap, "late", T0 + 30_001))  # ghost never asked again
    assert res.woken == ()
    assert cap.snapshot("m", now_ms=T0 + 30_001)["queued"]["background"] == 0


def test_models_without_limits_are_unmetered_but_learn_pauses(r: redis.Redis) -> None:
    cap = make(r, {"m": {"rpm": 1}})
    grants = [granted(grab(cap, f"w{i}", T0, model="other")) for i in range(200)]
    assert {g.deployment for g in grants} == {"default"}
    assert {g.lease_id for g in grants} == {""}  # nothing held them: nothing to release
    assert not cap.snapshot("other", now_ms=T0)["configured"]
    # A busy answer pauses the unconfigured model for every worker: newcomers queue.
    busy(cap, "other", 1000, now_ms=T0)
    q = queued(grab(cap, "late", T0 + 10, model="other"))
    assert q.position == 1 and q.next_slot_ms == T0 + 1000
    late = granted(grab(cap, "late", T0 + 1000, model="other"))
    assert late.lease_id
    for g in grants:
        cap.release(g.lease_id, now_ms=T0 + 1000)
    assert cap.snapshot("other", now_ms=T0 + 1000)["streams_in_use"] <= 1
    # Its lease still out, the next round takes one too; once it is back, none again.
    after = granted(grab(cap, "after", T0 + 1001, model="other"))
    assert after.lease_id
    cap.release(late.lease_id, now_ms=T0 + 1002)
    cap.release(after.lease_id, now_ms=T0 + 1002)
    # The pause hash expires as its pause ends, on Redis's clock (this test's is its own).
    r.delete(f"{cap.prefix}:{{other}}:paused")
    assert granted(grab(cap, "last", T0 + 1003, model="other")).lease_id == ""


def cap_keys(r: redis.Redis, cap: Capacity) -> set[str]:
    """The suffixes of the capacity's keys in Redis (`leases`, `q:i`...), any model's."""
    return {k.decode().split("}:", 1)[1] for k in r.scan_iter(match=f"{cap.prefix}:*")}


def test_a_model_without_limits_that_nothing_holds_writes_nothing(r: redis.Redis) -> None:
    for cap in (make(r, {"m": {"rpm": 1}}), Capacity(r, {}, prefix=f"test:cap:{uuid.uuid4()}")):
        g = granted(cap.acquire("free", waiter="w", owner="o", interactive=True, tokens=700))
        assert (g.model, g.deployment, g.lease_id, g.tokens) == ("free", "default", "", 700)
        assert g.granted_at_ms > T0 and g.woken == () and g.wake_next is None
        # No lease, grant, queue or usage: renewing and releasing have nothing to do.
        assert cap.renew(g.lease_id) and cap.release(g.lease_id, tokens_used=9) == Wakes()
        cap.report_success("free", "default")
        assert cap.withdraw("free", "w") == Wakes()
        snap = cap.snapshot("free")
        assert snap["streams_in_use"] == 0 and snap["grants_outstanding"] == 0
        assert cap_keys(r, cap) == set()


def _time_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_time", {}).get("calls", 0))


def test_a_pause_is_forgotten_when_it_ends_and_rounds_go_without_the_clock_again(
    r: redis.Redis,
) -> None:
    cap = make(r, {})
    before = _time_calls(r)
    assert (
        granted(cap.acquire("m", waiter="a", owner="o", interactive=True, tokens=1)).lease_id == ""
    )
    assert _time_calls(r) == before  # nothing held, nothing paused: no clock read
    busy(cap, "m", 300)
    paused_key = f"{cap.prefix}:{{m}}:paused"
    assert 0 < int(r.pttl(paused_key)) <= 301
    assert isinstance(cap.acquire("m", waiter="b", owner="o", interactive=True, tokens=1), Queued)
    assert _time_calls(r) > before  # a pause is read against Redis' clock
    cap.withdraw("m", "b")
    deadline = time.monotonic() + 10
    while r.exists(paused_key) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not r.exists(paused_key)
    # A longer pause of a deployment keeps the hash while it lasts; a shorter one later does
    # not cut it short.
    busy(cap, "m", 5000, deployment="eu")
    busy(cap, "m", 100)
    assert int(r.pttl(paused_key)) > 4000
    r.delete(paused_key)
    for_clock = _time_calls(r)
    g = granted(cap.acquire("m", waiter="c", owner="o", interactive=True, tokens=1))
    assert g.lease_id == "" and abs(g.granted_at_ms - time.time() * 1000) < 5000
    assert _time_calls(r) == for_clock


def _hdel_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_hdel", {}).get("calls", 0))


def test_an_unleased_success_forgets_failures_only_this_process_counted(r: redis.Redis) -> None:
    cap = make(r, {})
    breaker = f"{cap.prefix}:{{m}}:breaker"
    before = _hdel_calls(r)
    cap.report_success("m", "default", unleased=True)
    assert _hdel_calls(r) == before  # admitted with no breaker hash: nothing to forget
    cap.report_failure("m", "default", "5xx", now_ms=T0)
    assert r.hget(breaker, "f:default") == b"1"
    cap.report_success("m", "default", unleased=True)  # this process counted one since
    assert not r.exists(breaker)
    # Another process's failure is forgotten by the next leased round's success.
    other = Capacity(r, {}, prefix=cap.prefix)
    other.report_failure("m", "default", "5xx", now_ms=T0)
    cap.report_success("m", "default", unleased=True)
    assert r.hget(breaker, "f:default") == b"1"
    cap.report_success("m", "default")
    assert not r.exists(breaker)


def test_a_model_without_limits_waits_while_the_fleet_holds_it(r: redis.Redis) -> None:
    cap = make(r, {}, breaker_failures=2, breaker_cooldown_ms=1000)
    # A queued round granted by another's call takes that grant when it asks again, though
    # the queue is empty by then: an outstanding grant keeps every round on the full path.
    busy(cap, "m", 500, now_ms=T0)
    queued(grab(cap, "a", T0 + 1))
    queued(grab(cap, "b", T0 + 2))
    b = granted(grab(cap, "b", T0 + 500))
    assert b.woken == ("a",) and b.lease_id
    a = granted(grab(cap, "a", T0 + 501))
    assert a.lease_id and a.granted_at_ms == T0 + 500
    assert cap.snapshot("m", now_ms=T0 + 501)["streams_in_use"] == 2
    cap.release(a.lease_id, now_ms=T0 + 502)
    cap.release(b.lease_id, now_ms=T0 + 502)
    # The pause has ended: its hash expires then, on Redis's clock (this test's is its own).
    r.delete(f"{cap.prefix}:{{m}}:paused")
    assert granted(grab(cap, "c", T0 + 503)).lease_id == ""
    # A provider's exhausted allowance holds its rounds too.
    cap.note_answer("m", "default", RateSignal(remaining_requests=0), now_ms=T0 + 600)
    assert queued(grab(cap, "d", T0 + 601)).next_slot_ms == T0 + 1600
    d = granted(grab(cap, "d", T0 + 1600))
    assert d.lease_id
    cap.release(d.lease_id, now_ms=T0 + 1601)
    # A failure on record: rounds take leases (a probe must hold one) until a success.
    cap.report_failure("m", "default", "5xx", now_ms=T0 + 2000)
    e = granted(grab(cap, "e", T0 + 2001))
    assert e.lease_id
    assert cap.report_failure("m", "default", "5xx", now_ms=T0 + 2002) == "open"
    assert queued(grab(cap, "f", T0 + 2003)).next_slot_ms == T0 + 3002
    cap.release(e.lease_id, now_ms=T0 + 2004)
    probe = granted(grab(cap, "f", T0 + 3002))
    assert probe.lease_id
    assert queued(grab(cap, "g", T0 + 3003)).next_slot_ms > T0 + 3003  # one probe at a time
    cap.report_success("m", "default")
    g = granted(grab(cap, "g", T0 + 3004))
    assert g.lease_id and g.woken == ()
    cap.release(probe.lease_id, now_ms=T0 + 3005)
    cap.release(g.lease_id, now_ms=T0 + 3005)
    r.delete(f"{cap.prefix}:{{m}}:paused")  # the allowance's pause ended (Redis's clock)
    assert granted(grab(cap, "h", T0 + 3006)).lease_id == ""
    # What is left holds nothing: ended pauses, virtual times, the minute's usage.
    assert cap_keys(r, cap) <= {"paused", "q:state", "usage"}  # pauses expire


def test_limits_anywhere_keep_every_round_on_a_lease(r: redis.Redis) -> None:
    # Only a model with no limit at all, for the model or any deployment, goes without.
    specs: list[dict[str, Any]] = [
        {"rpm": 6000},
        {"tpm": 10**9},
        {"streams": 100},
        {"deployments": [{"name": "a"}, {"name": "b", "rpm": 6000}]},
        # least_loaded counts each deployment's streams by their leases.
        {"strategy": "least_loaded", "deployments": [{"name": "a"}, {"name": "b"}]},
    ]
    for spec in specs:
        cap = make(r, {"m": spec})
        got = [granted(grab(cap, f"w{i}", T0)) for i in range(4)]
        assert all(g.lease_id for g in got), spec
        if spec.get("strategy") == "least_loaded":
            assert [g.deployment for g in got] == ["a", "b", "a", "b"]
    # Deployments without limits, taken in order: the first, without a lease.
    cap = make(r, {"m": {"deployments": [{"name": "a"}, {"name": "b"}]}}, breaker_failures=1)
    assert granted(grab(cap, "x", T0)).lease_id == ""
    cap.report_failure("m", "a", "5xx", now_ms=T0)
    failover = granted(grab(cap, "y", T0 + 1))
    assert (failover.deployment, bool(failover.lease_id)) == ("b", True)


def commands(r: redis.Redis) -> Counter[str]:
    stats = r.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()})


def count_commands(r: redis.Redis, fn: Callable[[], object]) -> Counter[str]:
    before = commands(r)
    fn()
    ran = commands(r) - before
    del ran["info"]
    return ran


def test_a_round_of_a_model_without_limits_costs_a_handful_of_commands() -> None:
    # A server of its own: nothing else's commands in its counts.
    with RedisServer() as server, redis.Redis.from_url(server.url) as r:
        limited = Capacity(r, parse_limits(json.dumps({"m": {"rpm": 6000}})))
        bare = Capacity(r, {})

        def round_of(cap: Capacity, model: str, waiter: str) -> None:
            g = granted(cap.acquire(model, waiter=waiter, owner="o", interactive=True, tokens=9))
            cap.report_success(model, g.deployment)
            cap.release(g.lease_id, tokens_used=5)

        for cap in (limited, bare):
            round_of(cap, "m", "warm")  # loads the scripts
        free = count_commands(r, lambda: round_of(bare, "free", "w1"))
        # The script and one look at the queue, grants, leases, breakers, pauses and the
        # fleet's stored limits; the breaker's HDEL of nothing.
        assert sum(free.values()) <= 3, free
        assert not free.keys() & {"set", "hset", "hincrby", "zadd", "zrem", "del"}, free
        metered = count_commands(r, lambda: round_of(limited, "m", "w2"))
        assert sum(metered.values()) >= 5 * sum(free.values()), metered
        # A configured model does not pay for the look, nor store its limits every round;
        # it reads its admitted rate (one HMGET a script).
        assert not metered.keys() & {"exists", "set", "get"}, metered
        assert metered["hmget"] <= 2, metered


def test_a_models_keys_share_one_cluster_slot(r: redis.Redis) -> None:
    cap = make(r, two("least_loaded"), breaker_failures=1)
    g = granted(grab(cap, "a", T0))
    # Long enough to outlast the test on a busy machine: a pause's hash expires with it.
    busy(cap, "m", 10_000, now_ms=T0)
    busy(cap, "m", 10_000, now_ms=T0, deployment="b")
    queued(grab(cap, "b", T0, interactive=True))
    cap.report_failure("m", "a", "5xx", now_ms=T0)
    cap.release(g.lease_id, tokens_used=5, now_ms=T0)
    keys = [k.decode() for k in r.scan_iter(match=f"{cap.prefix}:*")]
    assert len(keys) >= 6
    assert all(k.startswith(f"{cap.prefix}:{{m}}:") for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1


def test_many_threads_sharing_one_limit_never_exceed_it(r: redis.Redis) -> None:
    # Redis's clock: 100 requests/s with a burst of 100, and at most 4 streams at once.
    cap = make(r, {"m": {"rpm": 6000, "streams": 4}})
    events: dict[str, threading.Event] = {}
    lock = threading.Lock()
    holding = 0
    most_held = 0
    grant_times: list[int] = []
    errors: list[BaseException] = []

    def wake(waiters: tuple[str, ...]) -> None:
        for w in waiters:
            events[w].set()

    def worker(k: int) -> None:
        nonlocal holding, most_held
        try:
            for i in range(50):
                waiter = f"t{k}:{i}"
                events[waiter] = threading.Event()
                while True:
                    res = cap.acquire(
                        "m", waiter=waiter, owner=f"o{k % 3}", interactive=k % 2 == 0, tokens=1
                    )
                    wake(res.woken)
                    if isinstance(res, Grant):
                        break
                    # The turn sleeps until its wakeup, or until someone's call grants it.
                    delay_s = max(res.retry_at_ms / 1000 - time.time(), 0.001)
                    events[waiter].wait(min(delay_s, 1.0))
                    events[waiter].clear()
                with lock:
                    holding += 1
                    most_held = max(most_held, holding)
                    grant_times.append(res.granted_at_ms)
                time.sleep(0.002)  # the stream itself
                with lock:
                    holding -= 1
                wake(cap.release(res.lease_id, tokens_used=1).woken)
        except BaseException as exc:  # the main thread reports it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert len(grant_times) == 400
    assert most_held <= 4
    assert max_in_window(grant_times, 1000) <= 199  # burst 100 + 100 refilled in the second
    assert max(grant_times) - min(grant_times) >= 2900  # 300 past the burst at 100/s
    snap = cap.snapshot("m")
    assert snap["streams_in_use"] == 0 and snap["queued"] == {"interactive": 0, "background": 0}


def test_a_process_without_the_limits_decides_by_the_fleets(r: redis.Redis) -> None:
    # A tool worker that steps a turn inline, or a client that aborts one, may run without
    # AGENTQ_LLM_LIMITS: it must not let rounds through unpaced.
    prefix = f"test:cap:{uuid.uuid4().hex[:8]}"
    configured = Capacity(r, parse_limits(json.dumps({"m": {"rpm": 60}})), prefix=prefix)
    bare = Capacity(r, {}, prefix=prefix)
    granted(grab(bare, "before", T0))  # nothing stored yet: unmetered
    granted(grab(configured, "a", T0 + 1))
    q = queued(grab(bare, "b", T0 + 2))
    assert q.next_slot_ms >= T0 + 1000
    assert granted(grab(bare, "b", q.next_slot_ms)).lease_id
