"""One no-op call's writes through the store, many times, on a private Redis: what the
store's scripts cost Redis and the caller, per call (issue 54's check that naming the
scripts' inputs cost nothing). Runs the writes of tests/integration/test_redis_cost.py.

    python scripts/bench_store_calls.py TREE N   # TREE: a checkout (its agentq is used)

Prints one JSON line: the client's CPU ms per call, Redis's usec per call (all commands,
and EVALSHA alone), and the commands per call.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    tree, n = sys.argv[1], int(sys.argv[2])
    sys.path.insert(0, tree)
    import redis

    import agentq
    import tests.integration.test_redis_cost as cost
    from agentq.local.redis_server import RedisServer
    from agentq.state.store import TurnStore

    assert agentq.__file__.startswith(tree), agentq.__file__
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        store = TurnStore(r)
        cost._one_call(store)  # the scripts loaded
        r.config_resetstat()
        c0 = time.process_time()
        for _ in range(n):
            cost._one_call(store)
        cpu_s = time.process_time() - c0
        stats = r.info("commandstats")
    total_usec = sum(v["usec"] for v in stats.values())
    calls = sum(v["calls"] for name, v in stats.items() if name != "cmdstat_info")
    out = {
        "tree": tree,
        "client_cpu_ms_per_call": round(cpu_s / n * 1000, 3),
        "redis_usec_per_call": round(total_usec / n, 1),
        "evalsha_usec_per_call": round(stats.get("cmdstat_evalsha", {}).get("usec", 0) / n, 1),
        "commands_per_call": round(calls / n, 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
