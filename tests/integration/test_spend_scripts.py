"""The budget scripts on a real Redis and on a Redis Cluster: RESERVE caps a round by
what its budgets leave (the one place that is decided), both scripts are idempotent,
settling moves a round's reservation to its usage in every budget it counts in, and a
turn's and its key's keys share one slot."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import redis

from agentq.config import ModelPrice, load_settings
from agentq.errors import BudgetExceeded
from agentq.fleet.connections import cluster_client
from agentq.local.cluster import LocalCluster
from agentq.local.redis_server import RedisServer
from agentq.models import Usage
from agentq.state.budget import MIN_COMPLETION_TOKENS, resets_at
from agentq.state.spend import (
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


class Case(NamedTuple):
    prompt: int
    expected: int | tuple[str, str]
    """The cap (bounded unless 4096, what the round wants), or the budget refusing it."""
    max_tokens: int | None = None
    max_usd: float | None = None
    key: dict[str, float] = {}
    price: ModelPrice | None = None
    spent: dict[str, float] = {}
    """What the turn (tokens, usd) and its key this day (day_tokens, day_usd) spent."""
    parent_max_tokens: int | None = None
    parent_spent: int = 0


CASES = {
    "no budget leaves what the round wants": Case(500, 4096, price=PRICE),
    "a token budget leaves what the prompt does not take": Case(
        500, 200, max_tokens=1000, spent={"tokens": 300}
    ),
    "an ample token budget": Case(500, 1500, max_tokens=2000),
    "a usd budget caps by the output price": Case(1000, 1000, max_usd=0.01, price=PRICE),
    "a key's usd budget too": Case(1000, 1000, key={"usd_per_day": 0.01}, price=PRICE),
    "a key's tokens per day": Case(1000, 500, key={"tokens_per_day": 1500}, price=PRICE),
    "the tightest of several": Case(
        1200, 200, max_tokens=5000, max_usd=0.004, key={"tokens_per_day": 1800}, price=PRICE
    ),
    "a usd budget of a model without a price counts nothing": Case(
        500, 4096, key={"usd_per_day": 0.0001}, spent={"day_usd": 1.0}
    ),
    "a turn usd budget of a model without a price too": Case(1000, 4096, max_usd=0.01),
    "exactly the least round passes": Case(5, MIN_COMPLETION_TOKENS, max_tokens=5 + 16),
    "one token less does not": Case(5, ("turn", "max_tokens"), max_tokens=4 + 16),
    "a prompt the budget cannot take": Case(590, ("turn", "max_tokens"), max_tokens=600),
    "a prompt past the budget": Case(500, ("turn", "max_tokens"), max_tokens=10),
    "a prompt the usd left cannot pay": Case(
        1000, ("turn", "max_cost_usd"), max_usd=0.001, price=PRICE
    ),
    "the tightest refuses, a parent's": Case(
        5,
        ("parent_turn", "max_tokens"),
        key={"tokens_per_day": 10**6},
        parent_max_tokens=1000,
        parent_spent=990,
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_reserve_caps_a_round_by_what_its_budgets_leave(client: redis.Redis, case: Case) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client, **({owner: case.key} if case.key else {}))
    own, day = turn_spend_key(owner, "t"), day_key(owner, DAY)
    for field, value in case.spent.items():
        key, name = (day, field[4:]) if field.startswith("day_") else (own, field)
        client.hset(key, name, value)
    parents = []
    if case.parent_max_tokens is not None:
        parents = ["p"]
        parent = turn_spend_key(owner, "p")
        client.hset(parent, mapping={"max_tokens": case.parent_max_tokens})
        client.hset(parent, "tokens", case.parent_spent)
    args = {"reservation": "0", "day": DAY, "prompt_tokens": case.prompt, "want": 4096}
    turn = {"owner": owner, "turn_id": "t", "parents": parents}
    limits = {"price": case.price, "max_tokens": case.max_tokens, "max_usd": case.max_usd}
    if isinstance(case.expected, int):
        got = spend.reserve(**turn, **args, **limits)  # type: ignore[arg-type]
        # Unbounded (None) only when no budget lowered what the round wants.
        assert got == (case.expected if case.expected != 4096 else None)
    else:
        with pytest.raises(BudgetExceeded) as refused:
            spend.reserve(**turn, **args, **limits)  # type: ignore[arg-type]
        assert (refused.value.scope, refused.value.budget) == case.expected


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
        assert got == 64
    keys = [turn_spend_key(owner, t) for t in ("child", "parent", "root")]
    for key in [day_key(owner, DAY), *keys]:
        assert int(client.hget(key, "tokens") or 0) == 164, key
    # A month counts dollars only: its one budget is usd_per_month.
    assert client.hget(month_key(owner, DAY[:6]), "tokens") is None
    assert float(client.hget(month_key(owner, DAY[:6]), "usd") or 0) > 0
    used = Usage(prompt_tokens=90, completion_tokens=10, cached_tokens=5, cost_usd=0.5)
    settle = Settlement(0, DAY, used, "m", "a")
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
    spend.reserve(owner, DAY, 34, None)
    with pytest.raises(BudgetExceeded) as refused:
        spend.reserve(
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
    assert refused.value.budget == "tokens_per_day"
    assert refused.value.resets_at == resets_at("tokens_per_day", DAY)
    with pytest.raises(BudgetExceeded) as refused:
        spend.reserve(owner, DAY, 34, None)
    assert refused.value.budget == "tokens_per_day"


def test_a_key_that_cannot_afford_the_least_round_refuses_starts(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client, **{owner: {"tokens_per_day": 1000, "usd_per_month": 1.0}})
    client.hset(day_key(owner, DAY), "tokens", 950)
    month = month_key(owner, DAY[:6])
    client.hset(month, "usd", 0.5)
    least = MIN_COMPLETION_TOKENS
    spend.reserve(owner, DAY, 40 - least, None)

    def refusal(prompt: int, price: ModelPrice | None) -> tuple[str, float, float]:
        with pytest.raises(BudgetExceeded) as refused:
            spend.reserve(owner, DAY, prompt, price)
        return refused.value.budget, refused.value.spent, refused.value.limit

    assert refusal(60 - least, None) == ("tokens_per_day", 950, 1000)
    # 10 prompt tokens at $0.06 each: $0.6 more than the month's $0.5 can take.
    assert refusal(10, ModelPrice(input=60_000.0, output=0.0)) == ("usd_per_month", 0.5, 1.0)
    # A model without a price is refused by a USD budget already spent past its limit.
    client.hset(month, "usd", 1.5)
    assert refusal(10, None) == ("usd_per_month", 1.5, 1.0)
    # A start's check reserves nothing, and refuses later starts by nothing.
    assert int(client.hget(day_key(owner, DAY), "tokens") or 0) == 950
    assert not [f for f in client.hkeys(day_key(owner, DAY)) if f.startswith(b"exhausted")]


def test_the_scripts_run_on_a_redis_cluster() -> None:
    with LocalCluster(masters=3) as cluster:
        client = cluster_client(cluster.nodes)
        try:
            owner = "k-cluster"
            spend = spend_of(client, **{owner: {"usd_per_day": 1.0}})
            month = month_key(owner, DAY[:6])
            keys = SpendKeys(day_key(owner, DAY), month, turn_spend_key(owner, "t"))
            slots = {client.keyslot(key) for key in [*keys, turn_spend_key(owner, "p")]}
            assert len(slots) == 1
            turn = {"owner": owner, "turn_id": "t", "parents": ["p"]}
            used = Usage(prompt_tokens=100, completion_tokens=20, cost_usd=0.001)
            for round_no in (0, 1):
                got = spend.reserve(
                    **turn,
                    reservation=str(round_no),
                    day=DAY,
                    prompt_tokens=100,
                    want=64,
                    price=PRICE,
                    max_tokens=None,
                    max_usd=None,
                )
                assert got == 64
                assert spend.settle(**turn, settle=Settlement(round_no, DAY, used, "m", None))
            assert float(client.hget(day_key(owner, DAY), "usd") or 0) == pytest.approx(0.002)
        finally:
            client.close()


def _reserve(spend: Spend, turn: dict[str, object], round_no: int, **kw: object) -> object:
    args: dict[str, object] = {"day": DAY, "want": 500, "price": None, "max_usd": None}
    args.update(kw)
    return spend.reserve(**turn, reservation=str(round_no), **args)  # type: ignore[arg-type]


def test_a_round_is_reserved_against_the_last_ones_usage(client: redis.Redis) -> None:
    owner = f"k-{uuid.uuid4().hex[:8]}"
    spend = spend_of(client)
    turn = {"owner": owner, "turn_id": "t", "parents": ["p"]}
    assert _reserve(spend, turn, 0, prompt_tokens=100, max_tokens=1000) == 500
    own, parent = turn_spend_key(owner, "t"), turn_spend_key(owner, "p")
    assert int(client.hget(own, "tokens") or 0) == 600
    used = Settlement(0, DAY, Usage(prompt_tokens=100, completion_tokens=50), "m", "a")
    assert spend.settle(**turn, settle=used)
    assert spend.turn_totals(owner, "t")["total_tokens"] == 150
    for _ in range(2):  # a step that runs again: reserved once
        # Against the real 150 spent, not the 600 reserved: 1000 - 150 - 200 leaves 650.
        got = _reserve(spend, turn, 1, prompt_tokens=200, max_tokens=1000)
        assert got == 500
        for key in (own, parent, day_key(owner, DAY)):
            assert int(client.hget(key, "tokens") or 0) == 150 + 700, key
        assert int(client.hget(own, "prompt") or 0) == 100
    day = {a.decode(): b.decode() for a, b in client.hgetall(day_key(owner, DAY)).items()}
    assert day["m|m|completion"] == "50" and day["a|a|turns"] == "1"
    assert owner in spend.owners()
    used = Settlement(1, DAY, Usage(prompt_tokens=200, completion_tokens=100), "m", "a")
    assert spend.settle(**turn, settle=used)
    # An earlier round settled again (a stale step) is found settled.
    assert not spend.settle(**turn, settle=Settlement(0, DAY, Usage(), "m", "a"))
    with pytest.raises(BudgetExceeded) as refused:
        _reserve(spend, turn, 2, prompt_tokens=900, max_tokens=1000)
    assert refused.value.budget == "max_tokens" and refused.value.resets_at is None
    assert refused.value.spent == 450
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
        settle = Settlement(round_no, DAY, used, "m", None)
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
    assert _reserve(spend, turn, 0, prompt_tokens=100, max_tokens=None) == 500
    used = Settlement(0, DAY, Usage(prompt_tokens=100, completion_tokens=20), "m", None)
    assert spend.settle(**turn, settle=used)
    after = "20261128"
    got = _reserve(spend, turn, 1, day=after, prompt_tokens=100, max_tokens=None)
    assert got == 500
    assert int(client.hget(day_key(owner, DAY), "tokens") or 0) == 120
    assert int(client.hget(day_key(owner, after), "tokens") or 0) == 600
