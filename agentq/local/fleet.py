"""One launcher for a local fleet: `agentq dev`, the benchmarks, the chaos soak and the tests.

A `LocalFleet` starts named processes (workers of a kind, a gateway, Flower, ...) by PID
with one environment, keeps an optional embedded Redis, and stops everything at once
(SIGTERM to all in parallel, so each warm shutdown runs while the others do), Redis last.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from agentq.local.processes import (
    CELERY_READY_PATTERN,
    ManagedProcess,
    start_process,
    start_worker,
)
from agentq.local.redis_server import RedisServer

__all__ = ["LocalFleet", "memory_mb"]


class LocalFleet:
    """Processes by name (workers by kind too) and an optional embedded Redis, stopped by PID."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        log_dir: Path | None = None,
        name: str = "",
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
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start `argv` as `name` with the fleet's environment (plus `env`), logging to log_dir."""
        proc = start_process(
            list(argv),
            env={**self.env, **(env or {})},
            log_path=self._log(name),
            ready_pattern=ready_pattern,
            ready_timeout_s=ready_timeout_s,
            cwd=cwd,
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
        ready_pattern: str = CELERY_READY_PATTERN,
    ) -> ManagedProcess:
        """`agentq worker KIND` under a unique node name, once Celery says it is ready."""
        if name is None:
            prefix = f"{self.name}-" if self.name else ""
            name = f"{prefix}{kind}-{uuid.uuid4().hex[:6]}"
        proc = start_worker(
            kind,
            env={**self.env, **(env or {})},
            hostname=f"{name}@%h",
            concurrency=concurrency,
            extra_args=extra_args,
            log_path=self._log(name),
            ready_timeout_s=ready_timeout_s,
            loglevel=loglevel,
            ready_pattern=ready_pattern,
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

    def memory_mb(self, measure: str = "rss") -> dict[str, float]:
        """Memory of every process by name, its pool children included (see `memory_mb`)."""
        return memory_mb(self.pids(), measure)

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


def memory_mb(pids: Mapping[str, int], measure: str = "rss") -> dict[str, float]:
    """Memory of each process and its children (a prefork pool), in MiB, by label.

    "rss" counts pages a forked pool shares with its parent once per process; "pss"
    splits shared pages between the processes that share them, so a prefork worker's
    sum is what it really costs (slower: reads smaps).
    """
    out: dict[str, float] = {}
    for label, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            total = 0
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error, AttributeError):
                    total += p.memory_full_info().pss if measure == "pss" else p.memory_info().rss
            out[label] = round(total / 2**20, 1)
    return out
