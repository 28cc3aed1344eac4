"""The shared launcher: workers by kind, by PID, with their memory, all stopped at once."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from agentq.local.fleet import LocalFleet
from agentq.local.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_a_fleet_starts_workers_by_kind_and_stops_them_and_its_redis(
    agentq_env: dict[str, str], tmp_path: Path
) -> None:
    redis = RedisServer().start()
    fleet = LocalFleet(agentq_env, log_dir=tmp_path, name="lf", redis=redis, stop_timeout_s=10)
    try:
        tools, llm = fleet.start_workers(["tools", "llm"], concurrency={"tools": 2})
        assert fleet.live("tools") == [tools] and fleet.live("llm") == [llm]
        assert tools.children_pids(), "a prefork tool worker has pool processes"
        # The node name carries the fleet's name and the kind; the log sits in log_dir.
        node = tools.argv[tools.argv.index("--hostname") + 1]
        assert node.startswith("lf-tools-") and node.endswith("@%h"), node
        assert tools.log_path.parent == tmp_path and "ready." in tools.log_text()

        helper = fleet.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        pids = fleet.pids()
        assert pids["sleeper"] == helper.pid and pids["redis"] == redis.pid
        mem = fleet.memory_mb()
        worker_name = next(n for n, p in fleet.procs.items() if p is tools)
        # The tool worker's figure counts its pool too: more than its main process alone.
        own_mb = psutil.Process(tools.pid).memory_info().rss / 2**20
        assert mem[worker_name] > own_mb and mem["redis"] > 0

        assert fleet.first_dead() is None
        code = helper.kill()
        assert fleet.first_dead() == ("sleeper", code)
        fleet.retire(helper)
        assert "sleeper" not in fleet.procs and fleet.first_dead() is None
    finally:
        fleet.stop()
    assert not tools.is_running() and not llm.is_running()
    assert not redis.is_running()
