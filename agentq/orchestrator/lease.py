"""Leases keep a live turn on one worker; the reaper resumes turns whose worker died."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from agentq import constants as k
from agentq.orchestrator.context import TurnContext
from agentq.store import TurnStore

log = logging.getLogger("agentq.lease")


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


class LeaseKeeper:
    """One thread per process renews the leases of every turn this process runs."""

    def __init__(self, store: TurnStore, lease_s: float) -> None:
        self.store = store
        self.lease_s = lease_s
        self._held: dict[str, tuple[str, TurnContext]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, ctx: TurnContext, holder: str) -> None:
        with self._lock:
            self._held[ctx.turn_id] = (holder, ctx)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentq-lease", daemon=True)
                self._thread.start()

    def drop(self, turn_id: str) -> None:
        with self._lock:
            held = self._held.pop(turn_id, None)
        if held is not None:
            self.store.release_lease(turn_id, held[0])

    def _run(self) -> None:
        while True:
            time.sleep(self.lease_s / 3)
            with self._lock:
                items = list(self._held.items())
            if not items:
                continue
            # One round trip for all: renewing turn by turn, a busy worker (hundreds of
            # turn threads on the GIL) let leases lapse and turns get resumed twice.
            try:
                kept = self.store.renew_leases({t: h for t, (h, _) in items}, self.lease_s)
            except Exception:
                log.warning("lease renewal failed", exc_info=True)
                continue
            with self._lock:
                # A turn that ended meanwhile released its lease: that is no loss.
                lost = [ctx for t, (_, ctx) in items if not kept[t] and t in self._held]
            for ctx in lost:
                log.warning("lost the lease on turn %s; stopping it here", ctx.turn_id)
                ctx.lease_lost = True


class Reaper:
    """Periodically resumes running turns whose lease lapsed (their worker died)."""

    def __init__(self, store: TurnStore, lease_s: float, resume: Callable[[str], None]) -> None:
        self.store = store
        self.lease_s = lease_s
        self.resume = resume
        self._stop = threading.Event()

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name="agentq-reaper", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

    def sweep(self) -> list[str]:
        resumed = []
        active = self.store.active()
        pipe = self.store.redis.pipeline(transaction=False)
        for turn_id in active:
            pipe.hget(k.turn_key(turn_id), "status")
            pipe.exists(k.lease_key(turn_id))
        found = pipe.execute()
        for i, turn_id in enumerate(active):
            status, leased = found[2 * i], found[2 * i + 1]
            if status is None or json.loads(status) != "running" or leased:
                continue
            claim = k.resume_claim_key(turn_id)
            if self.store.redis.set(claim, holder_id(), nx=True, px=int(self.lease_s * 1000)):
                log.warning("turn %s lost its worker; resuming it", turn_id)
                self.resume(turn_id)
                resumed.append(turn_id)
        return resumed

    def _run(self) -> None:
        while not self._stop.wait(max(0.2, self.lease_s / 2)):
            try:
                self.sweep()
            except Exception:
                log.warning("reaper sweep failed", exc_info=True)
