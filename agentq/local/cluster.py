"""A throw-away Redis Cluster on 127.0.0.1: `redis-server --cluster-enabled yes` processes
(masters, and replicas for failover tests), each an `RedisServer` stopped by its PID.

    with LocalCluster(masters=3, replicas=1) as cluster:
        os.environ["AGENTQ_REDIS_CLUSTER_NODES"] = cluster.nodes
        ...
        cluster.fail_master_of("agentq:turn:{abc}")  # kill it; its replica takes over

It needs Redis >= 7 (sharded pub/sub): `$AGENTQ_REDIS_SERVER`, else the first such
`redis-server` on PATH or in /usr/bin, /usr/local/bin.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import redis
from redis.crc import key_slot

from agentq.fleet.lifecycle import Started
from agentq.local.redis_server import RedisServer, RedisServerError, find_free_port, port_is_free

SLOTS = 16384
MIN_VERSION = (7, 0)
NODE_TIMEOUT_MS = 1000
"""How long a master may be silent before its replica is promoted: short, for tests."""


def _version(executable: str) -> tuple[int, int]:
    try:
        out = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return (0, 0)
    m = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def find_cluster_redis_server() -> str:
    """A `redis-server` new enough for agentq on Cluster (>= 7: SSUBSCRIBE, SPUBLISH)."""
    candidates = [
        os.environ.get("AGENTQ_REDIS_SERVER"),
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
        "/usr/local/bin/redis-server",
    ]
    for exe in candidates:
        if exe and os.path.exists(exe) and _version(exe) >= MIN_VERSION:
            return exe
    raise RedisServerError("no redis-server >= 7.0 found (set AGENTQ_REDIS_SERVER)")


def _info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO as a dict (its answer is `field:value` lines)."""
    raw = client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if isinstance(raw, dict):
        return {str(k_): str(v) for k_, v in raw.items()}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(50):
        port = find_free_port()
        if port + 10000 < 65536 and port_is_free(port + 10000):
            return port
    raise RedisServerError("no free port pair (port, port + 10000) for a cluster node")


class LocalCluster(Started):
    """`masters` masters sharing the slots evenly, each with `replicas` replicas."""

    def __init__(self, masters: int = 3, replicas: int = 0, *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.executable = find_cluster_redis_server()
        self.masters: list[RedisServer] = []
        self.replicas: list[RedisServer] = []
        self._want = (masters, replicas)

    @property
    def servers(self) -> list[RedisServer]:
        return [*self.masters, *self.replicas]

    @property
    def nodes(self) -> str:
        """`AGENTQ_REDIS_CLUSTER_NODES` for this cluster."""
        return ",".join(f"127.0.0.1:{s.port}" for s in self.masters)

    def _server(self) -> RedisServer:
        return RedisServer(
            _cluster_port(),
            executable=self.executable,
            extra_args=(
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
            ),
        )  # fmt: skip

    def start(self) -> LocalCluster:
        n_masters, n_replicas = self._want
        try:
            self.masters = [self._server().start() for _ in range(n_masters)]
            self.replicas = [self._server().start() for _ in range(n_masters * n_replicas)]
            self._form(n_replicas)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, n_replicas: int) -> None:
        per = SLOTS // len(self.masters)
        first = self.masters[0]
        for i, m in enumerate(self.masters):
            last = SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * per - 1
            with m.client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for s in self.servers[1:]:
            with s.client() as c:
                c.execute_command("CLUSTER", "MEET", first.host, first.port)
        self._wait(lambda: all(self._known(s) == len(self.servers) for s in self.servers))
        for i, r in enumerate(self.replicas):
            master = self.masters[i // n_replicas]
            with master.client() as c:
                master_id = c.execute_command("CLUSTER", "MYID")
            with r.client() as c:
                c.execute_command("CLUSTER", "REPLICATE", master_id)
        self._wait(self._ok)

    def _known(self, s: RedisServer) -> int:
        with s.client() as c:
            return int(_info(c).get("cluster_known_nodes", "0"))

    def _ok(self) -> bool:
        """Every live node sees the whole cluster up, and each replica is in sync."""
        for s in self.servers:
            if not s.is_running():
                continue
            with s.client() as c:
                if _info(c).get("cluster_state") != "ok":
                    return False
                if s in self.replicas:
                    info = c.info("replication")
                    if info.get("role") == "slave" and info.get("master_link_status") != "up":
                        return False
        return True

    def _wait(self, done: object, what: str = "the cluster to form") -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if callable(done) and done():
                    return
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.05)
        raise RedisServerError(f"timed out waiting for {what}")

    def master_of(self, key: str) -> RedisServer:
        """The live master that serves `key`'s slot now (as a live node sees it)."""
        slot = key_slot(key.encode())
        for s in self.servers:
            if not s.is_running():
                continue
            with s.client() as c:
                ranges = c.execute_command("CLUSTER SLOTS")
            for start, end, master, *_ in ranges:
                if int(start) <= slot <= int(end):
                    port = int(master[1])
                    found = next((x for x in self.servers if x.port == port), None)
                    if found is not None and found.is_running():
                        return found
        raise RedisServerError(f"no live master serves slot {slot}")

    def fail_master_of(self, key: str) -> RedisServer:
        """Kill the master serving `key` (SIGKILL, by PID) and wait until one of its
        replicas has taken its slots over; the killed server is returned."""
        dead = self.master_of(key)
        dead.kill()

        def promoted() -> bool:
            try:
                new = self.master_of(key)
            except RedisServerError:  # nobody serves the slot yet
                return False
            return new is not dead and self._ok_without(dead)

        self._wait(promoted, "a replica to take the failed master's slots")
        return dead

    def _ok_without(self, dead: RedisServer) -> bool:
        for s in self.servers:
            if s is dead or not s.is_running():
                continue
            with s.client() as c:
                if _info(c).get("cluster_state") != "ok":
                    return False
        return True

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
