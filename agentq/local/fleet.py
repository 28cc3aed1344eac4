"""One launcher for a local fleet: `agentq dev`, the benchmarks, the chaos soak and the tests.

A `LocalFleet` starts named processes (workers of a kind, a gateway, Flower, ...) by PID
with one environment, keeps an optional embedded Redis, and stops everything at once
(SIGTERM to all in parallel, so each warm shutdown runs while the others do), Redis last.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from agentq.local.processes import ManagedProcess, start_process, start_worker
from agentq.local.redis_server import RedisServer

__all__ = ["LocalFleet"]


class LocalFleet:
    """Processes by name (workers by kind too) and an optional embedded Redis, stopped by PID."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        log_dir: Path | None = None,
        name: str = "agentq",
        redis: RedisServer | None = None,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.name = name
        self.redis = redis
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, ManagedProcess] = {}
        self.kinds: dict[str, str] = {}
        self.retired: list[ManagedProcess] = []
        self._lock = threading.Lock()

    # -- starting ----------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_pattern: str | None = None,
        ready_timeout_s: float = 30,
    ) -> ManagedProcess:
        """Start `argv` as `name` with the fleet's environment (plus `env`), logging to log_dir."""
        proc = start_process(
            list(argv),
            env={**self.env, **(env or {})},
            log_path=self._log(name),
            ready_pattern=ready_pattern,
            ready_timeout_s=ready_timeout_s,
            name=name,
        )
        with self._lock:
            self.procs[name] = proc
        return proc

    def start_worker(
        self,
        kind: str,
        *,
        name: str | None = None,
        concurrency: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 30,
        loglevel: str = "INFO",
    ) -> ManagedProcess:
        """`agentq worker KIND` under a unique node name, once Celery says it is ready."""
        name = name or f"{self.name}-{kind}-{uuid.uuid4().hex[:6]}"
        proc = start_worker(
            kind,
            env={**self.env, **(env or {})},
            hostname=f"{name}@%h",
            concurrency=concurrency,
            extra_args=extra_args,
            log_path=self._log(name),
            ready_timeout_s=ready_timeout_s,
            loglevel=loglevel,
        )
        with self._lock:
            self.procs[name] = proc
            self.kinds[name] = kind
        return proc

    def start_workers(
        self,
        kinds: Iterable[str],
        *,
        concurrency: Mapping[str, int] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 30,
    ) -> list[ManagedProcess]:
        """Start workers of these kinds in parallel (each takes seconds to be ready)."""
        kinds = list(kinds)
        conc = dict(concurrency or {})

        def one(kind: str) -> ManagedProcess:
            return self.start_worker(
                kind,
                concurrency=conc.get(kind),
                extra_args=extra_args,
                env=env,
                ready_timeout_s=ready_timeout_s,
            )

        with ThreadPoolExecutor(max_workers=len(kinds) or 1) as pool:
            return list(pool.map(one, kinds))

    # -- looking -----------------------------------------------------------------

    def workers(self, kind: str | None = None) -> list[ManagedProcess]:
        """Workers still in the fleet (running or not), of one kind or all, oldest first."""
        with self._lock:
            return [
                p
                for n, p in self.procs.items()
                if n in self.kinds and kind in (None, self.kinds[n])
            ]

    def live(self, kind: str | None = None) -> list[ManagedProcess]:
        """Workers of a kind (or all) whose process runs."""
        return [p for p in self.workers(kind) if p.is_running()]

    def retire(self, proc: ManagedProcess) -> None:
        """Take a (stopped or stopping) process out of the fleet; `stop()` still reaps it."""
        with self._lock:
            for name, p in list(self.procs.items()):
                if p is proc:
                    del self.procs[name]
                    self.kinds.pop(name, None)
            self.retired.append(proc)

    def first_dead(self) -> tuple[str, int] | None:
        """The name and exit code of a process that exited, or ("redis", -1)."""
        for name, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is not None:
                return name, rc
        if self.redis is not None and not self.redis.is_running():
            return "redis", -1
        return None

    def pids(self) -> dict[str, int]:
        """Main PID of every process, by name (Redis under "redis")."""
        out = {name: p.pid for name, p in self.procs.items()}
        if self.redis is not None and self.redis.is_running():
            out["redis"] = self.redis.pid
        return out

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of every process and its children (a prefork pool), in MB."""
        out: dict[str, float] = {}
        for name, pid in self.pids().items():
            try:
                proc = psutil.Process(pid)
                tree = [proc, *proc.children(recursive=True)]
                out[name] = sum(p.memory_info().rss for p in tree) / 1e6
            except psutil.Error:
                continue
        return out

    # -- stopping ----------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every process at once, wait (kill past the timeout), then stop Redis."""
        with self._lock:
            procs = [*self.procs.values(), *self.retired]
        if procs:
            with ThreadPoolExecutor(len(procs)) as pool:
                list(pool.map(lambda p: p.stop(timeout_s=self.stop_timeout_s), procs))
        if self.redis is not None:
            self.redis.stop()

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{name}.log"
