"""Turn state on a local Redis Cluster (3 masters, each with a replica), started by the
fixture and stopped by PID: a turn's keys on one slot, its events over sharded pub/sub,
replay and resume from the log, a master failing over while events are published, and
the store split into shards spread evenly over the masters. Whole turns on a cluster with
real workers: tests/faults/test_faults_cluster.py."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import ConfigError
from agentq.events.bus import EventBus, event_body
from agentq.events.follow import follow
from agentq.fleet.connections import cluster_client
from agentq.local.cluster import LocalCluster
from agentq.local.processes import wait_for
from agentq.orchestrator.steps import Sweeper
from agentq.state.base import active_turns

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as c:
        yield c


def _turn(client: object, turn_id: str) -> None:
    """A running turn's state hash, as the store leaves it after the first step."""
    client.hset(k.turn_key(turn_id), mapping={"status": json.dumps("running")})  # type: ignore[attr-defined]


def test_the_setting_names_the_cluster_and_a_bad_one_fails_at_start(cluster: LocalCluster) -> None:
    settings = Settings(redis_cluster_nodes=cluster.nodes)
    client = cluster_client(settings.redis_cluster_nodes or "")
    try:
        # Three masters, each serving a third of the slots: the client knows them all.
        assert len(client.get_primaries()) == 3
        assert client.ping()
    finally:
        client.close()
    with pytest.raises(ConfigError) as err:
        Settings(redis_cluster_nodes="127.0.0.1:7000,nonsense")
    assert err.value.setting == "AGENTQ_REDIS_CLUSTER_NODES"


def test_a_turns_keys_share_one_slot_and_turns_spread_over_the_masters(
    cluster: LocalCluster,
) -> None:
    turn_id = uuid.uuid4().hex
    keys = [
        *k.turn_keys(turn_id),
        k.turn_key(turn_id, "children"),
        k.turn_key(turn_id, "events"),
        k.turn_key(turn_id, "cancel"),
        k.turn_key(turn_id, "interaction", "c1.approval"),
        k.turn_key(turn_id, "secret", "c1.password"),
    ]
    assert {key_slot(key.encode()) for key in keys} == {key_slot(k.turn_key(turn_id).encode())}
    masters = {cluster.master_of(k.turn_key(uuid.uuid4().hex)).port for _ in range(60)}
    assert len(masters) == 3


def test_events_go_over_sharded_pubsub_and_replay_from_the_log(cluster: LocalCluster) -> None:
    client = cluster_client(cluster.nodes)
    bus = EventBus(client)
    turn_id = uuid.uuid4().hex
    _turn(client, turn_id)
    master = cluster.master_of(k.turn_key(turn_id))
    node = master.client()

    def spublished() -> int:
        stats = node.info("commandstats")
        return int(stats.get("cmdstat_spublish", {}).get("calls", 0))

    seen: list[int] = []
    subscribed = threading.Event()

    def follower() -> None:
        for ev in follow(bus, turn_id, heartbeat_s=0.2):
            subscribed.set()
            if ev is not None:
                seen.append(ev.seq)

    # Nobody follows yet: the event goes to the log only, no channel.
    assert bus.publish(turn_id, "llm_started", model="m") == 1
    before = spublished()
    t = threading.Thread(target=follower, daemon=True)
    t.start()
    wait_for(lambda: seen == [1], 10, message="the logged event, replayed")
    # The follower counts itself in: the next events are published to the shard channel.
    wait_for(
        lambda: int(client.hget(k.turn_key(turn_id), "watchers") or 0) == 1,
        10,
        message="follower counted",
    )
    for i in range(3):
        bus.publish(turn_id, "tool_progress", i=i)
    bus.publish(turn_id, "turn_finished", reason="stop")
    t.join(10)
    assert seen == [1, 2, 3, 4, 5]
    assert spublished() - before == 4
    # Resuming after the second event (Last-Event-ID) yields the rest, once each.
    log = bus.replay(turn_id)
    rest = [ev.seq for ev in follow(bus, turn_id, after=log[1].stream_id or "") if ev]
    assert rest == [3, 4, 5]
    # The follower counted itself out when it stopped.
    assert int(client.hget(k.turn_key(turn_id), "watchers") or 0) == 0
    node.close()
    client.close()


def test_a_batch_of_many_turns_events_lands_on_every_shard(cluster: LocalCluster) -> None:
    """A stream worker publishes the events of all its turns in one batch: on a Cluster
    that is one script call per shard (redis-py's cluster pipeline refuses scripts, and
    the batch was lost whole when it spanned shards)."""
    k.set_shard_count(16)  # as every process of a Cluster fleet has it
    client = cluster_client(cluster.nodes)
    try:
        bus = EventBus(client)
        turns = [uuid.uuid4().hex for _ in range(40)]
        for t in turns:
            _turn(client, t)
        client.hincrby(k.turn_key(turns[0]), "watchers", 1)  # type: ignore[attr-defined]
        delta = {"round_no": 0, "kind": "text", "text": "x"}
        bodies = {t: [event_body(t, "llm_delta", delta)] * 3 for t in turns}
        assert len({k.shard_of(t) for t in turns}) > 1
        assert bus.publish_many(bodies) == {turns[0]}
        for t in turns:
            assert [e.seq for e in bus.replay(t)] == [1, 2, 3]
    finally:
        client.close()
        k.set_shard_count(None)


def test_a_master_failing_over_mid_turn_loses_no_acknowledged_event(
    cluster: LocalCluster,
) -> None:
    client = cluster_client(cluster.nodes)
    bus = EventBus(client)
    turn_id = uuid.uuid4().hex
    _turn(client, turn_id)
    for i in range(5):
        bus.publish(turn_id, "tool_progress", i=i)
    master = cluster.master_of(k.turn_key(turn_id))
    # The store's settling writes WAIT for a replica (AGENTQ_REDIS_MIN_REPLICAS_ACKED): the
    # same here, so the events published so far are on the replica that takes over.
    with master.client() as node:
        assert int(node.execute_command("WAIT", 1, 5000)) == 1
    dead = cluster.fail_master_of(k.turn_key(turn_id))
    assert dead.port == master.port
    # The same client goes on: it finds the promoted replica and reloads its scripts there.
    t0 = time.monotonic()
    for i in range(5, 10):
        bus.publish(turn_id, "tool_progress", i=i)
    assert time.monotonic() - t0 < 30
    assert [ev.seq for ev in bus.replay(turn_id)] == list(range(1, 11))
    assert [ev.fields["i"] for ev in bus.replay(turn_id)] == list(range(10))
    client.close()


def test_the_store_runs_on_the_cluster_in_shards_and_refuses_wait(cluster: LocalCluster) -> None:
    from agentq.fleet import runtime

    runtime.reset()
    try:
        store = runtime.get_store(Settings(redis_cluster_nodes=cluster.nodes))
        assert k.shard_count() == k.DEFAULT_CLUSTER_SHARDS
        # Each shard's indexes live on a slot of their own share of the slots: with three
        # masters holding even ranges, each master holds a third of the shards.
        per_master = Counter(cluster.master_of(k.shard_key(k.WAKEUPS, s)).port for s in k.shards())
        assert sorted(per_master.values()) == [5, 5, 6]
        turn_id = "0a0b" + uuid.uuid4().hex[4:]
        keys = [k.turn_key(turn_id), k.shard_key(k.WAKEUPS, turn_id)]
        keys += [k.shard_key(k.TURNS_INDEX, turn_id)]
        assert len({key_slot(key.encode()) for key in keys}) == 1
        store.create(turn_id, {"status": "queued", "created_at": time.time()}, [])
        assert active_turns(store.redis) == [turn_id]
        # One sweep's look reads every shard's wakeups, the kills and the workers, on
        # three masters, in one pipeline.
        look = Sweeper(store, None, Settings()).look(time.time() + 60)  # type: ignore[arg-type]
        assert turn_id in look.wakeups and look.kills == [] and look.next_at is None
    finally:
        runtime.reset()
    # WAIT counts one connection's writes; a Cluster client spreads them over many.
    with pytest.raises(ConfigError) as err:
        Settings(redis_cluster_nodes=cluster.nodes, redis_min_replicas_acked=1)
    assert err.value.setting == "AGENTQ_REDIS_MIN_REPLICAS_ACKED"


def test_a_command_whose_master_is_gone_fails_after_one_backoff_not_nested_ones() -> None:
    # The client's waits between retries are its own (BackoffCluster), once: redis-py 8.2
    # waits between its cluster retries too, and a backoff there multiplied them (about
    # 28 s for 6 retries; 5 minutes for the default 20, instead of about 16 s).
    own = LocalCluster(masters=3).start()
    try:
        client = cluster_client(own.nodes, retries=6)
        client.set("k", 1)
        port = client.get_node_from_key("k").port
        next(s for s in own.servers if s.port == port).stop()
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            client.get("k")
        assert time.monotonic() - t0 < 15.0
    finally:
        own.stop()
