"""Which workers are alive, and which queues no live worker consumes.

Every worker says every WORKER_HEARTBEAT_S which queues it consumes (one field of
`agentq:fleet:presence`, gone when it stops cleanly; older than WORKER_ALIVE_TTL_S: dead or
cut off), so `agentq run`, /healthz and POST /v1/turns tell a user what to start instead of
leaving a turn queued in silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from agentq import constants as k

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

PRUNE_AFTER_S = 86400.0
"""A worker silent this long is forgotten by the next reader."""
GRACE_S = 2.0
"""How long a turn may wait before a watcher looks for its workers: one started with it
(`agentq dev`) needs a moment to say it is alive."""
WATCH_EVERY_S = 1.0
CACHE_S = 1.0
"""How long a gateway reuses what it read (a busy gateway reads once a second at most)."""
TURN_QUEUES = (k.QUEUE_TURNS, k.QUEUE_LLM)
"""What every turn needs: a turn worker for its steps, a stream worker for its rounds."""
KIND = {
    k.QUEUE_TURNS: "turns",
    k.QUEUE_LLM: "llm",
    k.QUEUE_TOOLS: "tools",
    k.QUEUE_IO: "io",
    k.QUEUE_WEBHOOKS: "io",
}
START = {q: f"agentq worker {kind}" for q, kind in KIND.items()}


def entry(role: str, queues: Iterable[str]) -> str:
    at = time.time()
    return json.dumps({"role": role, "queues": sorted(queues), "pid": os.getpid(), "at": at})


def live_queues(redis: Any) -> dict[str, list[str]]:
    """Queue -> the hostnames of the live workers that consume it."""
    now = time.time()
    out: dict[str, list[str]] = {}
    stale = []
    for host, raw in redis.hgetall(k.PRESENCE).items():
        try:
            data = json.loads(raw)
            at = float(data["at"])
        except (ValueError, KeyError, TypeError):
            continue
        if now - at > PRUNE_AFTER_S:
            stale.append(host)
        if now - at > k.WORKER_ALIVE_TTL_S:
            continue
        for queue in data.get("queues") or ():
            out.setdefault(str(queue), []).append(host.decode())
    if stale:
        redis.hdel(k.PRESENCE, *stale)
    return out


def missing(redis: Any, needed: Iterable[str] = TURN_QUEUES) -> list[str]:
    """The queues of `needed` that no live worker consumes, in the order given."""
    live = live_queues(redis)
    return [q for q in dict.fromkeys(needed) if q not in live]


def kinds(queues: Iterable[str]) -> list[str]:
    """The worker kinds (`turns`, `llm`, `tools`, `io`) that consume these queues; a queue
    of its own (a tool's `queue=`) is named as it is."""
    return list(dict.fromkeys(KIND.get(q, q) for q in queues))


def advice(queues: list[str]) -> str:
    """One line naming what to start for each queue no live worker consumes."""
    parts = []
    for q in queues:
        start = START.get(q)
        how = f"`{start}`" if start else "the tool or I/O worker whose tools use it"
        parts.append(f"{q} (start {how})")
    return "no live worker consumes " + ", ".join(parts)


def workers_view(live: dict[str, list[str]]) -> dict[str, Any]:
    """/healthz's part: live workers per agentq queue, and the kinds a turn needs that none
    serves."""
    return {
        "workers": {q: len(live.get(q, ())) for q in START},
        "missing_workers": missing_kinds(live),
    }


def missing_kinds(live: dict[str, list[str]]) -> list[str]:
    """The worker kinds every turn needs that no live worker serves."""
    return kinds(q for q in TURN_QUEUES if q not in live)


class Presence:
    """`live_queues` for a process that asks often (the gateway): one read per CACHE_S."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._lock = threading.Lock()
        self._read_at = -CACHE_S
        self._live: dict[str, list[str]] = {}

    def live(self) -> dict[str, list[str]]:
        with self._lock:
            if time.monotonic() - self._read_at >= CACHE_S:
                self._live = live_queues(self._redis)
                self._read_at = time.monotonic()
            return self._live


def waiting_on(store: TurnStore, turn_id: str) -> list[str] | None:
    """The queues a turn needs now (its workers', its unstarted calls'); None once it ended."""
    from agentq.models import TERMINAL_STATUSES

    state = store.state(turn_id) or {}
    if state.get("status") in TERMINAL_STATUSES:
        return None
    starts, dispatched, _ = store.call_progress(turn_id)
    unstarted = {cid: d.get("queue") for cid, d in dispatched.items() if cid not in starts}
    if unstarted:
        # A call settled without a start (refused, aborted) waits for nothing.
        settled = store.results(turn_id)
        unstarted = {cid: q for cid, q in unstarted.items() if cid not in settled}
    return [*TURN_QUEUES, *(str(q) for q in unstarted.values() if q)]


class Watch:
    """While a turn waits, says which queue it needs has no live worker and what to start,
    again when that changes; `needs` gives the queues (`waiting_on`), by default those
    every turn needs, until its owner ends the watch."""

    def __init__(
        self,
        turn_id: str,
        needs: Callable[[], list[str] | None] | None,
        redis: Any,
        say: Callable[[str], None],
    ) -> None:
        self.turn_id, self._needs, self._redis, self._say = turn_id, needs, redis, say
        self.done = threading.Event()
        self.said: list[str] = []

    def start(self) -> Watch:
        threading.Thread(target=self._run, name="agentq-worker-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        if self.done.wait(GRACE_S):
            return
        while not self.done.is_set():
            with contextlib.suppress(Exception):
                self.look()
            self.done.wait(WATCH_EVERY_S)

    def look(self) -> None:
        needed = self._needs() if self._needs is not None else list(TURN_QUEUES)
        if needed is None:
            self.done.set()
            return
        gone = missing(self._redis, needed)
        if gone == self.said:
            return
        self.said = gone
        if gone:
            self._say(f"turn {self.turn_id} waits: {advice(gone)}")
        else:
            self._say(f"turn {self.turn_id}: the workers it needs are alive now")
