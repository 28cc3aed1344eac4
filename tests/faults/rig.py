"""The fault suite's rig: its own Redis, scripted model and workers, which tests may kill.

Workers get tiny real limits (a 1.5 s lease, a 1.5 s grace) and the fault tools of
tests/faults/tools.py; the test process's environment points at the same Redis while
the rig lives. Every process is stopped by PID in `Rig.close()`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agentq.api import Client
from agentq.events import TERMINAL_TYPES, Event
from agentq.fleet import runtime
from agentq.local.cluster import LocalCluster
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess
from agentq.local.redis_server import RedisServer
from agentq.testing.openai_server import Round, ScriptedOpenAIServer
from tests.helpers import collect, script
from tests.rigs.ratelimit import ProviderLimits
from tests.rigs.sentinel import SentinelCluster
from tests.rigs.workers import worker_env

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "artifacts" / "faults"
FAULT_TOOLS = "agentq.testing.tools,tests.faults.tools,tests.waitpoint_tools"
DEFAULT_CONCURRENCY = {"tools": 4, "llm": 8, "turns": 32}


def fault_env(redis_url: str, llm_url: str, **extra: str) -> dict[str, str]:
    """The settings every fault worker and the test process share: tiny real limits."""
    # Workers import tests.faults.tools from the repository root.
    return worker_env(redis_url, llm_url, tools=FAULT_TOOLS, pythonpath=str(ROOT), **extra)


class Rig:
    """One Redis, one scripted model server, any number of workers; stopped by PID."""

    def __init__(
        self,
        name: str,
        *,
        appendonly: bool = False,
        sentinel: bool = False,
        cluster: bool = False,
        **env: str,
    ) -> None:
        self.name = name
        # On a Cluster (3 masters, a replica each) the turn state lives there, and the
        # rig's plain Redis is the broker and Celery's result backend.
        self.redis_cluster = LocalCluster(masters=3, replicas=1).start() if cluster else None
        if self.redis_cluster is not None:
            env = {"AGENTQ_REDIS_CLUSTER_NODES": self.redis_cluster.nodes, **env}
        # Behind Sentinel, every process reaches Redis through the sentinel:// URL only.
        self.cluster = SentinelCluster(appendonly=appendonly).start() if sentinel else None
        self.redis = self.cluster.servers[0] if self.cluster else RedisServer(appendonly=appendonly)
        self.redis.start()
        self.limits = ProviderLimits()
        """The model server's rate limits (off until a test sets them)."""
        self.llm = ScriptedOpenAIServer(rate_limit=self.limits).start()
        if self.cluster is not None:
            env = {"AGENTQ_REDIS_SENTINEL_MASTER": self.cluster.master_name, **env}
        redis_url = self.cluster.url if self.cluster else self.redis.url
        self.env = fault_env(redis_url, self.llm.url, **env)
        self.fleet = LocalFleet(self.env, log_dir=LOGS, name=name, stop_timeout_s=5)
        self._saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        runtime.reset()
        self.client = Client()

    # -- processes ---------------------------------------------------------------

    def start(
        self,
        *kinds: str,
        concurrency: dict[str, int] | None = None,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> list[ManagedProcess]:
        """Start workers of these kinds at once (in parallel: each takes seconds)."""
        return self.fleet.start_workers(
            kinds,
            concurrency={**DEFAULT_CONCURRENCY, **(concurrency or {})},
            extra_args=extra_args,
            env=env,
            ready_timeout_s=60,
        )

    @property
    def workers(self) -> list[ManagedProcess]:
        """Every process the rig started, oldest first."""
        return list(self.fleet.procs.values())

    def worker(self, kind: str) -> ManagedProcess:
        """The newest live worker of a kind."""
        live = self.fleet.live(kind)
        assert live, f"no live {kind} worker"
        return live[-1]

    def logs(self) -> str:
        return "\n".join(w.log_text() for w in self.workers)

    def close(self) -> None:
        self.fleet.stop()
        self.llm.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.redis_cluster is not None:
            self.redis_cluster.stop()
        self.redis.stop()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        runtime.reset()

    # -- turns -------------------------------------------------------------------

    def script(self, *rounds: Round) -> str:
        """A fresh script key: a prompt starting with it plays these rounds."""
        return script(self.llm, *rounds)

    def collect(
        self, turn_id: str, timeout_s: float = 30, until: Callable[[Event], bool] | None = None
    ) -> list[Event]:
        """Events of a turn from the start, until a terminal one (or `until`)."""
        return collect(self.client, turn_id, timeout_s, until=until, heartbeat_s=0.25)

    def follow(self, turn_id: str, timeout_s: float = 40) -> tuple[threading.Thread, list[Event]]:
        """Follow a turn from a thread, as a client would; events land in the list as they come."""
        seen: list[Event] = []
        stop = time.monotonic() + timeout_s

        def run() -> None:
            for ev in self.client.events(turn_id, heartbeat_s=0.25):
                if ev is not None:
                    seen.append(ev)
                    if ev.type in TERMINAL_TYPES and not ev.path:
                        return
                if time.monotonic() > stop:
                    return

        thread = threading.Thread(target=run, name=f"follow-{turn_id[:8]}", daemon=True)
        thread.start()
        return thread, seen

    def log_events(self, turn_id: str) -> list[Event]:
        """The whole replay log of a turn."""
        return self.client._store.bus.replay(turn_id, "0-0", count=100_000)
