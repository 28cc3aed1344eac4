"""The budget scripts on a real Redis and on a Redis Cluster: RESERVE caps a round as
`budget.completion_cap` decides, both scripts are idempotent, settling moves a round's
reservation to its usage in every budget it counts in, and a turn's and its key's keys
share one slot."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis

from agentq.config import ModelPrice, load_settings
from agentq.fleet.connections import cluster_client
from agentq.local.cluster import LocalCluster
from agentq.local.redis_server import RedisServer
from agentq.models import Usage
from agentq.state.budget import Budget, completion_cap
from agentq.state.spend import (
    Reserved,
    Settlement,
    Spend,
    SpendKeys,
    day_key,
    month_key,
    turn_spend_key,
)

pytestmark = pytest.mark.integration

DAY = "20261127"
PRICE = ModelPrice(input=2.0, output=8.0)


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        yield r
        r.close()


def spend_of(r: redis.Redis, **budgets: dict[str, float]) -> Spend:
    return Spend(r, load_settings(key_budgets=json.dumps(budgets)))


@pytest.mark.parametrize(
    ("max_tokens", "max_usd", "day_tokens", "prompt", "price"),
    [
        (None, None, None, 500, None),
        (2000, None, None, 500, None),
        (600, None, None, 590, None),
        (None, 0.01, None, 1000, PRICE),
        (None, 0.01, None, 1000, None),
        (None, None, 1500, 1000, PRICE),
        (5000, 0.004, 1800, 1200, PRICE),
        (10, None, None, 500, None),
    ],
)
def test_reserve_caps_a_round_as_the_pure_decision_does(
    client: redis.Redis,
    max_tokens: int | None,
    max_usd: float | None,
    day_tokens: int | None,
    prompt: int,
    price: ModelPrice | None,
) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    budgets = {owner: {"tokens_per_day": day_tokens}} if day_tokens else {}
    spend = spend_of(client, **budgets)
    got = spend.reserve(
        owner=owner,
        turn_id="t",
        parents=[],
        reservation="0",
        day=DAY,
        prompt_tokens=prompt,
        want=4096,
        price=price,
        max_tokens=max_tokens,
        max_usd=max_usd,
    )
    limits = [
        *([Budget("key", "tokens_per_day", "tokens", day_tokens, 0)] if day_tokens else []),
        *([Budget("turn", "max_tokens", "tokens", max_tokens, 0)] if max_tokens else []),
        *([Budget("turn", "max_cost_usd", "usd", max_usd, 0)] if max_usd else []),
    ]
    expected = completion_cap(limits, prompt, 4096, price)
    if expected.exceeded is None:
        assert isinstance(got, Reserved) and got.cap == expected.cap
    else:
        assert isinstance(got, Budget)
        assert (got.scope, got.name, got.limit) == (
            expected.exceeded.scope,
            expected.exceeded.name,
            expected.exceeded.limit,
        )


def test_reserve_and_settle_run_once_and_move_every_budget(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client, **{owner: {"tokens_per_day": 100_000}})
    turn = {"owner": owner, "turn_id": "child", "parents": ["root", "parent"]}
    args = {**turn, "day": DAY}
    for _ in range(2):  # a step that runs again finds its reservation
        got = spend.reserve(
            **args,
            reservation="0",
            prompt_tokens=100,
            want=64,
            price=PRICE,
            max_tokens=None,
            max_usd=None,
        )
        assert got == Reserved(64, True)
    keys = [turn_spend_key(owner, t) for t in ("child", "parent", "root")]
    for key in [day_key(owner, DAY), *keys]:
        assert int(client.hget(key, "tokens") or 0) == 164, key
    # A month counts dollars only: its one budget is usd_per_month.
    assert client.hget(month_key(owner, DAY[:6]), "tokens") is None
    assert float(client.hget(month_key(owner, DAY[:6]), "usd") or 0) > 0
    used = Usage(prompt_tokens=90, completion_tokens=10, cached_tokens=5, cost_usd=0.5)
    settle = Settlement(0, True, DAY, used, "m", "a")
    assert spend.settle(**turn, settle=settle) is True
    assert spend.settle(**turn, settle=settle) is False
    for key in [day_key(owner, DAY), *keys]:
        assert int(client.hget(key, "tokens") or 0) == 100, key
        assert float(client.hget(key, "usd") or 0) == pytest.approx(0.5), key
    day = {a.decode(): b.decode() for a, b in client.hgetall(day_key(owner, DAY)).items()}
    assert day["m|m|prompt"] == "90" and day["m|m|completion"] == "10"
    assert day["a|a|cached"] == "5" and day["m|m|turns"] == "1"
    # The key's totals are its models' sum, not counted a third time.
    assert not [f for f in day if f.startswith("all|")]
    assert spend.turn_totals(owner, "root")["total_tokens"] == 100
    assert owner in spend.owners()


def test_a_key_that_refused_a_round_refuses_starts(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client, **{owner: {"tokens_per_day": 1000}})
    assert spend.key_refusal(owner, DAY, tokens=50, usd=0.0) is None
    got = spend.reserve(
        owner=owner,
        turn_id="t",
        parents=[],
        reservation="0",
        day=DAY,
        prompt_tokens=990,
        want=64,
        price=None,
        max_tokens=None,
        max_usd=None,
    )
    assert isinstance(got, Budget) and got.name == "tokens_per_day"
    refusal = spend.key_refusal(owner, DAY, tokens=50, usd=0.0)
    assert refusal is not None and refusal.name == "tokens_per_day"


def test_the_scripts_run_on_a_redis_cluster() -> None:
    with LocalCluster(masters=3) as cluster:
        client = cluster_client(cluster.nodes)
        try:
            owner = "k-cluster"
            spend = spend_of(client, **{owner: {"usd_per_day": 1.0}})
            month = month_key(owner, DAY[:6])
            keys = SpendKeys(
                day_key(owner, DAY), month, day_key(owner, DAY), month, turn_spend_key(owner, "t")
            )
            slots = {client.keyslot(key) for key in [*keys, turn_spend_key(owner, "p")]}
            assert len(slots) == 1
            turn = {"owner": owner, "turn_id": "t", "parents": ["p"]}
            args = {**turn, "day": DAY}
            got = spend.reserve(
                **args,
                reservation="0",
                prompt_tokens=100,
                want=64,
                price=PRICE,
                max_tokens=None,
                max_usd=None,
            )
            assert got == Reserved(64, True)
            used = Usage(prompt_tokens=100, completion_tokens=20, cost_usd=0.001)
            # The next round's RESERVE settles this one (one script a round).
            got = spend.reserve(
                **args,
                reservation="1",
                prompt_tokens=150,
                want=64,
                price=PRICE,
                max_tokens=None,
                max_usd=None,
                settle=Settlement(0, True, DAY, used, "m", None),
            )
            assert got == Reserved(64, True)
            assert spend.settle(**turn, settle=Settlement(1, True, DAY, used, "m", None))
            assert spend.key_budgets(owner, DAY)[0].spent == pytest.approx(0.002)
        finally:
            client.close()


def _reserve(spend: Spend, turn: dict[str, object], round_no: int, **kw: object) -> object:
    args: dict[str, object] = {"day": DAY, "want": 500, "price": None, "max_usd": None}
    args.update(kw)
    return spend.reserve(**turn, reservation=str(round_no), **args)  # type: ignore[arg-type]


def test_reserve_settles_the_last_round_before_it_reserves(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client)
    turn = {"owner": owner, "turn_id": "t", "parents": ["p"]}
    assert _reserve(spend, turn, 0, prompt_tokens=100, max_tokens=1000) == Reserved(500, True)
    own, parent = turn_spend_key(owner, "t"), turn_spend_key(owner, "p")
    assert int(client.hget(own, "tokens") or 0) == 600
    used = Settlement(0, True, DAY, Usage(prompt_tokens=100, completion_tokens=50), "m", "a")
    for _ in range(2):  # a step that runs again: settled once, reserved once
        # Against the real 150 spent, not the 600 reserved: 1000 - 150 - 200 leaves 650.
        got = _reserve(spend, turn, 1, prompt_tokens=200, max_tokens=1000, settle=used)
        assert got == Reserved(500, True)
        for key in (own, parent, day_key(owner, DAY)):
            assert int(client.hget(key, "tokens") or 0) == 150 + 700, key
        assert int(client.hget(own, "prompt") or 0) == 100
    day = {a.decode(): b.decode() for a, b in client.hgetall(day_key(owner, DAY)).items()}
    assert day["m|m|completion"] == "50" and day["a|a|turns"] == "1"
    assert owner in spend.owners()
    # A round refused: the last one is settled all the same.
    used = Settlement(1, True, DAY, Usage(prompt_tokens=200, completion_tokens=100), "m", "a")
    refused = _reserve(spend, turn, 2, prompt_tokens=900, max_tokens=1000, settle=used)
    assert isinstance(refused, Budget) and refused.name == "max_tokens"
    assert refused.spent == 450
    assert int(client.hget(own, "tokens") or 0) == 450
    assert client.hget(own, "r:1") is None and client.hget(own, "r:2") is None


def test_a_round_without_a_reservation_is_settled_once_with_its_retention(
    client: redis.Redis,
) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client)
    turn = {"owner": owner, "turn_id": "free", "parents": []}
    used = Usage(prompt_tokens=30, completion_tokens=7, cached_tokens=3, cost_usd=0.25)
    for round_no in (0, 1):
        settle = Settlement(round_no, False, DAY, used, "m", None)
        assert spend.settle(**turn, settle=settle) is True
        assert spend.settle(**turn, settle=settle) is False
    own = turn_spend_key(owner, "free")
    for key in (own, day_key(owner, DAY), month_key(owner, DAY[:6])):
        assert client.ttl(key) > 0, key
    assert spend.turn_totals(owner, "free") == {
        "prompt_tokens": 60,
        "completion_tokens": 14,
        "cached_tokens": 6,
        "total_tokens": 74,
        "cost_usd": 0.5,
    }
    day = {a.decode(): b.decode() for a, b in client.hgetall(day_key(owner, DAY)).items()}
    assert day["tokens"] == "74" and day["m|m|turns"] == "1"
    assert float(day["usd"]) == pytest.approx(0.5)


def test_a_round_reserved_before_midnight_is_settled_in_its_day(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client, **{owner: {"tokens_per_day": 10_000}})
    turn = {"owner": owner, "turn_id": "late", "parents": []}
    assert _reserve(spend, turn, 0, prompt_tokens=100, max_tokens=None) == Reserved(500, True)
    used = Settlement(0, True, DAY, Usage(prompt_tokens=100, completion_tokens=20), "m", None)
    after = "20261128"
    got = _reserve(spend, turn, 1, day=after, prompt_tokens=100, max_tokens=None, settle=used)
    assert got == Reserved(500, True)
    assert int(client.hget(day_key(owner, DAY), "tokens") or 0) == 120
    assert int(client.hget(day_key(owner, after), "tokens") or 0) == 600


def test_a_turns_spend_counts_its_answered_round_at_its_usage(client: redis.Redis) -> None:
    """Between a round's answer and the next round's RESERVE, the turn's spend shows the
    round's usage (kept in the turn's state) and not its reservation."""
    from agentq import constants as k

    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client)
    turn_id = f"t-{uuid.uuid4().hex[:8]}"
    turn = {"owner": owner, "turn_id": turn_id, "parents": []}
    assert _reserve(spend, turn, 0, prompt_tokens=100, max_tokens=5000) == Reserved(500, True)
    assert spend.turn_totals(owner, turn_id)["total_tokens"] == 600
    used = {"round": 0, "model": "m", "prompt_tokens": 90, "completion_tokens": 10}
    client.hset(k.turn_key(turn_id), "budget_usage", json.dumps(used))
    try:
        totals = spend.turn_totals(owner, turn_id)
        assert (totals["prompt_tokens"], totals["completion_tokens"]) == (90, 10)
        assert totals["total_tokens"] == 100 and totals["max_tokens"] == 5000
        # Once settled (the state still naming it), it is not counted twice.
        settle = Settlement(0, True, DAY, Usage(prompt_tokens=90, completion_tokens=10), "m", None)
        assert spend.settle(**turn, settle=settle)
        assert spend.turn_totals(owner, turn_id)["total_tokens"] == 100
    finally:
        client.delete(k.turn_key(turn_id))
