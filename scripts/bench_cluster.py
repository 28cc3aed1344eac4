"""The cluster stage: the same turns on the bench's one Redis and on a local Redis Cluster of
three masters, and what each Redis spent on them.

A turn here is a streamed model round, one async tool call, and a closing round: the
I/O stage's turn with short waits. For each run the stage counts the Redis commands and
the Redis CPU (`INFO cpu`, the server's own user+sys time) the turns cost, and, on the
cluster, how the work spread over the masters. On the 2-core test VM the workers and the
Redis servers share the cores, so the cluster does not make turns faster here: what it
shows is that the state's load divides over the masters.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from agentq import constants as k
from agentq.fleet import runtime
from agentq.local.cluster import LocalCluster
from agentq.local.fleet import LocalFleet
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_stages import BenchRig, Sizes, turn_statuses

TOOL_WAIT_S = 0.5
STREAM_CHUNKS = 10
TERMINAL = ("finished", "aborted", "error")


def _turn_rounds() -> list[Round]:
    call = ScriptedCall(name="aio_sleep", arguments={"seconds": TOOL_WAIT_S})
    first = Round(text="x" * 4 * STREAM_CHUNKS, chunk_size=4, tool_calls=[call])
    return [first, Round(text="y" * 4 * STREAM_CHUNKS, chunk_size=4)]


def _usage(clients: list[redis.Redis]) -> tuple[list[float], list[int]]:
    """CPU seconds and commands each server has spent since it started."""
    cpu, commands = [], []
    for c in clients:
        info: dict[str, Any] = c.info("cpu")
        cpu.append(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]))
        stats: dict[str, Any] = c.info("commandstats")
        commands.append(sum(int(v["calls"]) for v in stats.values()))
    return cpu, commands


def _run_turns(fx: BenchRig, n: int, servers: list[redis.Redis], prefix: str) -> dict[str, Any]:
    """n turns at once through this process's current settings; what the servers spent."""
    from agentq.api import Client

    client = Client()
    store = runtime.get_store()
    key = fx.script(*_turn_rounds())
    cpu0, cmd0 = _usage(servers)
    t0 = time.perf_counter()
    ids = [client._start_turn(f"{key} #{i}").turn_id for i in range(n)]
    statuses: list[Any] = []
    while time.perf_counter() - t0 < 120 + n * 0.1:
        statuses = turn_statuses(store, ids)
        if all(s in TERMINAL for s in statuses):
            break
        time.sleep(0.5)
    took = time.perf_counter() - t0
    cpu1, cmd1 = _usage(servers)
    cpu_ms = [round((b - a) * 1000 / n, 3) for a, b in zip(cpu0, cpu1, strict=True)]
    commands = [round((b - a) / n, 1) for a, b in zip(cmd0, cmd1, strict=True)]
    counts = Counter(str(s) for s in statuses)
    return {
        f"{prefix}_turns": n,
        f"{prefix}_all_finished": counts.get("finished") == n,
        f"{prefix}_statuses": dict(counts),
        f"{prefix}_seconds": round(took, 2),
        f"{prefix}_turns_per_s": round(n / took, 1),
        f"{prefix}_redis_cpu_ms_per_turn": round(sum(cpu_ms), 3),
        f"{prefix}_redis_commands_per_turn": round(sum(commands), 1),
        f"{prefix}_per_server_cpu_ms_per_turn": cpu_ms,
        f"{prefix}_per_server_commands_per_turn": commands,
    }


def _cluster_fleet(fx: BenchRig, cluster: LocalCluster) -> LocalFleet:
    """Turn, llm and io workers whose state is on the cluster; the broker is the bench's
    Redis, on a database of its own so the main fleet's workers take none of its tasks."""
    assert fx.redis is not None
    env = {
        **fx.env,
        "AGENTQ_REDIS_URL": fx.redis.url.rsplit("/", 1)[0] + "/3",
        "AGENTQ_REDIS_CLUSTER_NODES": cluster.nodes,
    }
    fleet = LocalFleet(env, name=f"bench-cluster-{fx.run_id}")
    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(fleet.start_worker, kind) for kind in ("turns", "llm", "io")]:
            f.result()
    return fleet


def bench_cluster(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    """The same turns on one Redis and on a 3-master cluster: Redis CPU and commands per
    turn, and how the cluster's masters shared them."""
    if fx.redis is None:
        return {"notes": ["cluster: needs the bench's own Redis (not --use-env-redis)"]}
    out: dict[str, Any] = {}
    out.update(_run_turns(fx, sz.cluster_turns, [fx.redis.client()], "one_redis"))
    saved = dict(os.environ)
    cluster = LocalCluster(masters=3).start()
    fleet: LocalFleet | None = None
    try:
        fleet = _cluster_fleet(fx, cluster)
        os.environ.update(fleet.env)
        runtime.reset()
        # The masters hold the state; the bench's Redis is the broker (counted apart).
        servers = [s.client() for s in cluster.servers] + [fx.redis.client()]
        out.update(_run_turns(fx, sz.cluster_turns, servers, "cluster"))
        out["cluster_shards"] = k.shard_count()
    finally:
        if fleet is not None:
            fleet.stop()
        cluster.stop()
        os.environ.clear()
        os.environ.update(saved)
        runtime.reset()
    *per, broker = out.pop("cluster_per_server_cpu_ms_per_turn")
    *cmds, broker_cmds = out.pop("cluster_per_server_commands_per_turn")
    out["cluster_masters_cpu_ms_per_turn"] = per
    out["cluster_masters_commands_per_turn"] = cmds
    out["cluster_broker_cpu_ms_per_turn"] = broker
    out["cluster_broker_commands_per_turn"] = broker_cmds
    out["cluster_redis_cpu_ms_per_turn"] = round(sum(per), 3)
    out["cluster_redis_commands_per_turn"] = round(sum(cmds), 1)
    if sum(per):
        out["cluster_busiest_master_share"] = round(max(per) / sum(per), 2)
    one = out["one_redis_redis_cpu_ms_per_turn"]
    if one:
        # What one Redis core carries at this turn's cost (the broker's share included).
        out["one_redis_turns_per_s_per_core"] = round(1000 / one)
    return out
