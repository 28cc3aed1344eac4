"""The state split into shards (as on a Redis Cluster), on fakeredis: every key of a turn and
its shard's indexes on one slot, children in their parent's shard, and the readers of the
indexes (sweeps, the active list, the listing and its pruning) merging every shard."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import fakeredis
import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from agentq import constants as k
from agentq.config import Settings
from agentq.models import TurnStatus
from agentq.orchestrator.steps import Sweeper
from agentq.orchestrator.subturns import child_turn_id
from agentq.state.base import active_turns
from agentq.state.listing import TurnLister, TurnQuery
from agentq.state.store import TurnStore


@pytest.fixture()
def shards() -> Iterator[int]:
    k.set_shard_count(4)
    yield 4
    k.set_shard_count(None)


def _slot(key: str) -> int:
    return key_slot(key.encode())


@pytest.mark.parametrize("n", [3, 16, 64])
def test_each_shard_tag_lies_in_its_share_of_the_slots(n: int) -> None:
    for shard in range(n):
        slot = _slot("{" + k.shard_tag(shard, n) + "}")
        share = REDIS_CLUSTER_HASH_SLOTS // n
        assert shard * share - 1 <= slot < (shard + 1) * share + 1, (shard, slot)


def test_a_turns_keys_its_indexes_and_its_children_share_one_slot(shards: int) -> None:
    parent = secrets.token_hex(16)
    child = child_turn_id(parent, "call_1")
    assert len(child) == 32 and child != parent and child[:4] == parent[:4]
    keys = [*k.turn_keys(parent), k.turn_key(parent, "children"), k.turn_key(parent, "events")]
    keys += [k.turn_key(parent, "interaction", "c.approval")]
    keys += [k.shard_key(k.WAKEUPS, parent), k.shard_key(k.TURNS_INDEX, parent)]
    keys += [k.turn_key(parent, "beat", "c")]
    keys += [k.turn_key(child), k.turn_key(child, "log")]
    assert {_slot(key) for key in keys} == {_slot(k.turn_key(parent))}
    # With one shard (one Redis) the names are the contract's: the tag is the turn id.
    k.set_shard_count(1)
    assert k.turn_key(parent) == f"agentq:turn:{{{parent}}}"
    assert k.shard_key(k.WAKEUPS, parent) == k.WAKEUPS == "agentq:turns:wakeups"


def test_sweeps_active_turns_and_the_listing_merge_every_shard(shards: int) -> None:
    store = TurnStore(fakeredis.FakeRedis())
    now = time.time()
    # 24 turns, at least one on every shard (random ids alone miss one now and then).
    ids: list[str] = []
    while len(ids) < shards:  # one on each shard first
        turn_id = secrets.token_hex(16)
        if k.shard_of(turn_id) not in {k.shard_of(t) for t in ids}:
            ids.append(turn_id)
    ids += [secrets.token_hex(16) for _ in range(24 - shards)]
    assert len({k.shard_of(t) for t in ids}) == shards
    for i, turn_id in enumerate(ids):
        store.create(turn_id, {"status": "running", "created_at": now - 100 + i}, [])
    assert active_turns(store.redis) == ids  # oldest first, whatever their shard
    look = Sweeper(store, None, Settings()).look(now + 60)  # type: ignore[arg-type]
    assert set(look.wakeups) == set(ids)
    store.close(ids[0], TurnStatus.FINISHED, "turn_finished", {})
    assert ids[0] not in active_turns(store.redis)

    lister = TurnLister(store.redis)
    page = lister.page(TurnQuery(limit=10))
    seen = [t["turn_id"] for t in page.turns]
    while page.next_before is not None:
        page = lister.page(TurnQuery(limit=10, before=page.next_before))
        seen += [t["turn_id"] for t in page.turns]
    assert seen == list(reversed(ids))  # newest first, across the shards, each once
    assert sum(store.redis.zcard(k.shard_key(k.TURNS_INDEX, s)) for s in k.shards()) == 24

    # A turn whose keys expired leaves the index of its own shard when the listing meets it.
    gone = ids[5]
    for key in k.turn_keys(gone):
        store.redis.delete(key)
    lister.page(TurnQuery(limit=50))
    assert store.redis.zscore(k.shard_key(k.TURNS_INDEX, gone), gone) is None
    assert sum(store.redis.zcard(k.shard_key(k.TURNS_INDEX, s)) for s in k.shards()) == 23


def test_the_shard_count_comes_from_the_settings() -> None:
    assert Settings().shard_count == 1
    assert Settings(redis_cluster_nodes="127.0.0.1:7000").shard_count == k.DEFAULT_CLUSTER_SHARDS
    assert Settings(redis_cluster_nodes="127.0.0.1:7000", redis_shards=6).shard_count == 6
    with pytest.raises(ValueError):
        Settings(redis_shards=0)
