"""The stream worker's events: every round's deltas and ends, published together."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from agentq.events.bus import event_body

if TYPE_CHECKING:
    from agentq.aio.host import LoopHost
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.llm")


Batch = dict[str, list[tuple[str, dict[str, Any]]]]
"""Events by turn, each turn's in order: (type, fields)."""


def publish_batch(store: TurnStore, batch: Batch) -> set[str]:
    """In a store thread: publish a batch; the turns of it someone follows."""
    return store.bus.publish_many(
        {
            turn_id: [event_body(turn_id, type_, fields) for type_, fields in events]
            for turn_id, events in batch.items()
        }
    )


@dataclasses.dataclass
class _Seen:
    """What the last publish of a turn's events found, and when (monotonic s)."""

    watched: bool
    at: float


class Publisher:
    """One per process: the pending events of every round go out in one pipelined round
    trip, so thousands of streams cost a few store calls a second, not one a chunk. Deltas
    wait out the settings' intervals, the quiet one for a turn nobody followed (most rounds
    are never watched live, and deltas are about half of what a turn costs Redis); the
    turn's other events take them along at once, and a round's end `take`s them."""

    def __init__(self, host: LoopHost, publish: Callable[[Batch], set[str]] | None = None) -> None:
        self.host = host
        settings = host.settings
        self.interval_s = settings.llm_delta_interval_ms / 1000
        quiet_ms = settings.llm_quiet_delta_interval_ms
        self.quiet_s = quiet_ms / 1000 if quiet_ms > settings.llm_delta_interval_ms else 0.0
        self.publish = publish or functools.partial(publish_batch, host.store)
        self.pending: Batch = {}
        self.in_flight: set[str] = set()
        self.seen: dict[str, _Seen] = {}
        self.pruned_at = time.monotonic()
        self.flushing: asyncio.Task[None] | None = None
        self.tick = asyncio.Event()
        """Set (and replaced) each time a batch has gone out."""
        self.wake = asyncio.Event()
        """Wakes the loop from its sleep: an event came that may not wait that long."""
        self.holding_until: float | None = None
        """While the loop sleeps (nothing to send now): until when."""
        self.resting: set[str] = set()
        """The turns whose interval after a batch the loop waits out."""

    def add(self, turn_id: str, type_: str, fields: dict[str, Any]) -> None:
        events = self.pending.setdefault(turn_id, [])
        if type_ == "llm_delta" and events:
            # A loaded worker publishes fewer, longer deltas instead of falling behind.
            last_type, last = events[-1]
            if (
                last_type == "llm_delta"
                and last["round_no"] == fields["round_no"]
                and last["kind"] == fields["kind"]
            ):
                last["text"] += fields["text"]
                return
        events.append((type_, fields))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.get_running_loop().create_task(self._flush())
        elif self.holding_until is not None and turn_id not in self.resting:
            # Not woken for each held delta: it scans every turn when it wakes (as it does at
            # the interval's end anyway), which per chunk would be thousands of turns.
            due = self._due(turn_id, time.monotonic()) if type_ == "llm_delta" else None
            if due is None or (not self.resting and due < self.holding_until):
                self.wake.set()

    def _due(self, turn_id: str, now: float) -> float | None:
        """When the turn's deltas may go out, if they are held now; else None."""
        seen = self.seen.get(turn_id)
        if seen is None or seen.watched:
            return None
        due = seen.at + self.quiet_s
        return due if due > now else None

    def _take(self, now: float, skip: Collection[str] = ()) -> tuple[Batch, float]:
        """The events to publish now (none of `skip`'s), and when the first held delta is due."""
        batch: Batch = {}
        first_due = math.inf
        for turn_id, events in self.pending.items():
            if turn_id in skip:
                continue
            due = self._due(turn_id, now)
            if due is not None and all(type_ == "llm_delta" for type_, _ in events):
                first_due = min(first_due, due)
            else:
                batch[turn_id] = events
        for turn_id in batch:
            del self.pending[turn_id]
        return batch, first_due

    async def _flush(self) -> None:
        """Send what may go now; after a batch, wait out the interval for its turns: another
        turn's first event goes at once, so no round's first token waits out another
        round's interval."""
        rest_until = 0.0
        while True:
            now = time.monotonic()
            if now >= rest_until:
                if not self.pending:
                    return
                self.resting = set()
            batch, first_due = self._take(now, self.resting)
            if batch:
                await self._send(batch, now)
                if not self.resting:
                    rest_until = time.monotonic() + self.interval_s
                self.resting.update(batch)
                continue
            self.wake.clear()
            self.holding_until = rest_until if self.resting else first_due
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.holding_until - now)
            finally:
                self.holding_until = None

    async def _send(self, batch: Batch, now: float) -> None:
        self.in_flight = set(batch)
        try:
            watched = await self.host.io(self.publish, batch)
        except Exception:
            log.warning("llm events not published", exc_info=True)
        else:
            if self.quiet_s:
                for turn_id in batch:
                    self.seen[turn_id] = _Seen(turn_id in watched, now)
                # Forget turns that published nothing for the quiet interval (nothing is held
                # for them either way): those whose round never reached `take`.
                if now - self.pruned_at >= self.quiet_s:
                    self.pruned_at = now
                    self.seen = {t: s for t, s in self.seen.items() if s.at + self.quiet_s > now}
        self.in_flight = set()
        tick, self.tick = self.tick, asyncio.Event()
        tick.set()

    def learned(self, turn_id: str, watched: bool) -> None:
        """What the round's claim found, as if its events went out now, unless a follower came."""
        if self.quiet_s and turn_id not in self.seen:
            self.seen[turn_id] = _Seen(watched, time.monotonic())

    def watched(self, turn_id: str) -> None:
        """Someone started following the turn: its deltas go live from now."""
        if self.quiet_s:
            self.seen[turn_id] = _Seen(True, time.monotonic())
            if turn_id in self.pending:
                self.wake.set()

    async def take(self, turn_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The turn's events not published yet, once those going out have gone, for the
        write of its round's result; what was learned of the turn is forgotten."""
        while turn_id in self.in_flight:
            await self.tick.wait()
        # Its next round (here or elsewhere) learns afresh.
        self.seen.pop(turn_id, None)
        taken = self.pending.pop(turn_id, [])
        if taken and not self.resting:
            self.wake.set()  # a loop that waits for held deltas alone may wait for none now
        return taken
