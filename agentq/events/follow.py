"""Follow a turn's events without gaps, its sub-agents' relayed into it.

One XREAD reads every followed log, blocking while it waits (a sub-agent's turn lives in
its parent's shard, so on a Cluster they share a slot). A sub-agent's events stay in its
own log: a reader of the parent merges the logs of the children it finds (each
`subturn_started` names one), up to `depth` levels, and marks their events with `path`.
Its position is a `Cursor`, so `Last-Event-ID` resumes every stream it had reached. A
stream closes, with those below it, at its turn's own terminal event; the follow stops at
the root's.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Generator, Iterator, KeysView
from dataclasses import dataclass, field
from typing import Any

import redis

from agentq.constants import RELAY_DEPTH_MAX, turn_key
from agentq.events import TERMINAL_TYPES, Event, SubturnStarted
from agentq.events.bus import WATCHERS_FIELD, EventBus
from agentq.models import TURN_ID, parse_stream_id

CHECK_S = 2.0
"""How often a follower checks that its counts in `watchers` are still there."""
PAGE = 1000
"""Events per log read."""
CURSOR_CHILDREN_MAX = 64
"""Open child streams a cursor may name: bounds what one `Last-Event-ID` costs to resume."""


@dataclass
class Cursor:
    """Where a reader of a turn stands: the root's stream id and each open child's, encoded
    `<root id>[,<child turn id>=<its stream id>]...`."""

    root: str = "0-0"
    children: dict[str, str] = field(default_factory=dict)

    def encode(self) -> str:
        return self.root + "".join(f",{t}={p}" for t, p in self.children.items())

    @classmethod
    def parse(cls, raw: str) -> Cursor:
        """Raises ValueError naming what is wrong (the gateway answers 422 with it)."""
        head, *rest = raw.strip().split(",")
        if parse_stream_id(head) is None:
            raise ValueError("must be a stream id like 1-0: two unsigned 64-bit integers")
        if len(rest) > CURSOR_CHILDREN_MAX:
            raise ValueError(f"names more than {CURSOR_CHILDREN_MAX} child streams")
        children: dict[str, str] = {}
        for part in rest:
            tid, _, pos = part.partition("=")
            if not TURN_ID.fullmatch(tid) or parse_stream_id(pos) is None:
                raise ValueError("a relayed stream's position is <turn id>=<stream id>")
            children[tid] = _norm(pos)
        return cls(_norm(head), children)


@dataclass
class _Stream:
    turn_id: str
    path: tuple[str, ...]
    """() for the root; else the turn ids from the root's direct child down to this one."""
    last_id: str = "0-0"


class Relay:
    """The streams of one follow and what each event read from their logs does to them."""

    def __init__(self, root: str, *, after: Cursor, depth: int) -> None:
        self.root = root
        self.depth = max(0, min(depth, RELAY_DEPTH_MAX))
        self.streams: dict[str, _Stream] = {root: _Stream(root, (), after.root)}
        self.done = False

    def resume(self, client: Any, after: Cursor) -> None:
        """Open the child streams a resuming cursor names, each found by a walk up its
        parents to the root within `depth` (a cursor never opens another turn's stream)."""
        for tid, pos in after.children.items():
            path = [tid]
            for _ in range(self.depth):
                raw = client.hget(turn_key(path[-1]), "parent_turn_id")
                parent = json.loads(raw) if raw else None
                if parent == self.root:
                    self.open(tid, tuple(reversed(path)), pos)
                    break
                if not isinstance(parent, str):
                    break
                path.append(parent)

    def open(self, turn_id: str, path: tuple[str, ...], after: str = "0-0") -> None:
        self.streams.setdefault(turn_id, _Stream(turn_id, path, after))

    def positions(self) -> dict[Any, Any]:
        """XREAD's streams: each open stream's log and position."""
        return {turn_key(t, "log"): s.last_id for t, s in self.streams.items()}

    def emit(self, stream: _Stream, ev: Event) -> Iterator[Event]:
        """Yield `ev`, the next of its stream; open or close streams as it says."""
        stream.last_id = ev.stream_id or stream.last_id
        if stream.path:
            ev = ev.model_copy(update={"path": list(stream.path)})
        child = ev.child_turn_id if isinstance(ev, SubturnStarted) else None
        if isinstance(child, str) and len(stream.path) < self.depth and TURN_ID.fullmatch(child):
            self.open(child, (*stream.path, child))
        ended = ev.type in TERMINAL_TYPES
        if ended and stream.path:
            # A child stream ended: it and every stream below it.
            for t in [t for t, s in self.streams.items() if stream.turn_id in s.path]:
                del self.streams[t]
        ev.cursor = Cursor(
            self.streams[self.root].last_id,
            {t: s.last_id for t, s in self.streams.items() if t != self.root},
        ).encode()
        yield ev
        if ended and not stream.path:
            self.done = True

    def take(self, reply: Any, page: int) -> Iterator[Event]:
        """Emit what one XREAD of `positions()` answered (`page` entries a log at most),
        merged by stream id so a child's events fall between the parent's around them.
        A full page that runs out, or a child that opens, ends it: the next read takes
        every log from where it stands."""
        turns = {turn_key(t, "log"): t for t in self.streams}
        pending = {
            turns[key.decode()]: deque(
                Event.parse(fields[b"e"], stream_id=eid.decode()) for eid, fields in entries
            )
            for key, entries in reply
        }
        full = {t for t, q in pending.items() if len(q) >= page}
        order = {t: i for i, t in enumerate(self.streams)}
        while not self.done:
            heads = []
            for t, q in pending.items():
                if t in full and not q and t in self.streams:
                    return
                if q and t in self.streams:
                    # By the millisecond of the stream id: the sequence part counts per
                    # stream, so within a millisecond the deeper stream goes first (a
                    # child's end and the settling of its call in the parent are one
                    # script, the child's end first).
                    ms = stream_pos(q[0].stream_id or "0-0")[0]
                    heads.append((ms, -len(self.streams[t].path), order[t], t))
            if not heads:
                return
            t = min(heads)[3]
            known = len(self.streams)
            yield from self.emit(self.streams[t], pending[t].popleft())
            if len(self.streams) > known:
                return


class Marks:
    """How often a follower counted itself in each open stream's `watchers`: a stream
    worker holds back the deltas of a turn nobody follows."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.counts: dict[str, int] = {}
        self.check_at = 0.0

    def due(self, turn_ids: KeysView[str]) -> bool:
        return turn_ids != self.counts.keys() or time.monotonic() >= self.check_at

    def keep(self, turn_ids: list[str]) -> None:
        """Count in where not counted: a stream just opened, a turn not created yet, and
        every CHECK_S one whose count is gone (a failover lost it); out of closed streams."""
        self.clear([t for t in self.counts if t not in turn_ids])
        check = time.monotonic() >= self.check_at
        for t in turn_ids:
            n = self.counts.get(t, 0)
            if not n or (check and not self.bus.redis.hget(turn_key(t), WATCHERS_FIELD)):
                self.counts[t] = n + int(self.bus.watch(t, 1))
        if check:
            self.check_at = time.monotonic() + CHECK_S

    def clear(self, turn_ids: list[str] | None = None) -> None:
        """Count out by as much as counted in; a follower that dies without this leaves
        the turn publishing live copies to nobody: a cost, not a fault."""
        for t in list(self.counts) if turn_ids is None else turn_ids:
            n = self.counts.pop(t, 0)
            if n:
                with contextlib.suppress(redis.RedisError):
                    self.bus.watch(t, -n)


def follow(
    bus: EventBus,
    turn_id: str,
    *,
    after: Cursor | str = "0-0",
    depth: int = 0,
    heartbeat_s: float | None = None,
    live: bool = True,
) -> Generator[Event | None, None, None]:
    """Yield every event after `after` exactly once, up to the root's end (`live`) or the
    logs' end; None after each `heartbeat_s` of silence, for keep-alives or noticing a gone
    client."""
    cursor = Cursor.parse(after) if isinstance(after, str) else after
    relay = Relay(turn_id, after=cursor, depth=depth)
    relay.resume(bus.redis, cursor)
    marks = Marks(bus)
    block_ms = max(1, int(1000 * (heartbeat_s or CHECK_S))) if live else None
    try:
        while not relay.done:
            if live and marks.due(relay.streams.keys()):
                marks.keep(list(relay.streams))
            reply = bus.redis.xread(relay.positions(), count=PAGE, block=block_ms)
            if reply:
                yield from relay.take(reply, PAGE)
            elif not live:
                return
            elif heartbeat_s is not None:
                yield None
    finally:
        marks.clear()


def stream_pos(stream_id: str) -> tuple[int, int]:
    """(ms, seq) of a stream id, to order ids by; (0, 0) for one that is not a stream id."""
    return parse_stream_id(stream_id) or (0, 0)


def _norm(stream_id: str) -> str:
    return "{}-{}".format(*stream_pos(stream_id))
