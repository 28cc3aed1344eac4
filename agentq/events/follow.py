"""Follow a turn's events without gaps, and relay its sub-agents' events into it.

A sub-agent's events stay in its own log: nothing is copied at publish time. A reader of
a parent merges the streams of the children it discovers (each `subturn_started` names
one), up to `depth` levels, and marks a child's events with `path`: the turn ids from
the parent's direct child down to the turn that emitted them. Its position is a
`Cursor`: the parent's stream id plus the position in each child stream still open, so
`Last-Event-ID` resumes every stream it had reached.

Nothing of a stream is relayed after the terminal event of the turn above it: a stream
closes (with its descendants) when its turn's own terminal event is yielded, and the
whole follow stops at the root's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from agentq.constants import RELAY_DEPTH_MAX, turn_key
from agentq.events import TERMINAL_TYPES, Event, SubturnStarted
from agentq.events.bus import EventBus
from agentq.models import TURN_ID, parse_stream_id

log = logging.getLogger("agentq.events")

CATCH_UP_S = 2.0
"""How often a silent follower re-reads the logs for events its subscription missed."""
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
    last_seq: int = 0


class Relay:
    """The streams of one follow and what each event does to them; no I/O but its hooks."""

    def __init__(self, root: str, *, after: Cursor, depth: int) -> None:
        self.root = root
        self.depth = max(0, min(depth, RELAY_DEPTH_MAX))
        self.streams: dict[str, _Stream] = {root: _Stream(root, (), after.root)}
        self.done = False

    def resume(self, client: redis.Redis, after: Cursor) -> None:
        """Open the child streams a resuming cursor names, each found by a walk up its
        parents to the root within `depth` (a cursor never opens another turn's stream)."""
        for tid, pos in after.children.items():
            path = [tid]
            for _ in range(self.depth):
                raw = client.hget(turn_key(path[-1]), "parent_turn_id")
                parent = json.loads(raw) if raw else None  # type: ignore[arg-type]
                if parent == self.root:
                    self.open(tid, tuple(reversed(path)), pos)
                    break
                if not isinstance(parent, str):
                    break
                path.append(parent)

    def opened(self, turn_id: str) -> None:
        pass

    def closed(self, turn_ids: list[str]) -> None:
        pass

    def open(self, turn_id: str, path: tuple[str, ...], after: str = "0-0") -> None:
        if turn_id not in self.streams:
            self.streams[turn_id] = _Stream(turn_id, path, after)
            self.opened(turn_id)

    def emit(self, stream: _Stream, ev: Event) -> Iterator[Event]:
        """Yield `ev` if it is new for its stream; open or close streams as it says."""
        if self.done or self.streams.get(stream.turn_id) is not stream:
            return
        if not _is_new(ev, stream.last_seq, stream.last_id):
            return
        stream.last_seq = ev.seq
        stream.last_id = ev.stream_id or stream.last_id
        if stream.path:
            ev = ev.model_copy(update={"path": list(stream.path)})
        child = ev.child_turn_id if isinstance(ev, SubturnStarted) else None
        if isinstance(child, str) and len(stream.path) < self.depth and TURN_ID.fullmatch(child):
            self.open(child, (*stream.path, child))
        ended = ev.type in TERMINAL_TYPES
        if ended and stream.path:
            # A child stream ended: it and every stream below it.
            gone = [t for t, s in self.streams.items() if stream.turn_id in s.path]
            for t in gone:
                del self.streams[t]
            self.closed(gone)
        ev.cursor = Cursor(
            self.streams[self.root].last_id,
            {t: s.last_id for t, s in self.streams.items() if t != self.root},
        ).encode()
        yield ev
        if ended and not stream.path:
            self.done = True

    def merge(
        self, pending: dict[str, deque[Event]], full: set[str]
    ) -> Generator[Event, None, list[str]]:
        """Emit the events read from the logs (`pending`, by turn id), merged by stream id so
        a child's events fall between the parent's around them, until a log must be read
        (again): returns the streams to read, [] once all read is emitted. `full` names the
        streams whose read was a full page: the merge needs their next page once they run
        out, and the log of a child an event opens."""
        order = {t: i for i, t in enumerate(self.streams)}
        while not self.done:
            heads = []
            for t, q in pending.items():
                if t in full and not q and t in self.streams:
                    return [t]
                if q and t in self.streams:
                    # By the millisecond of the stream id: the sequence part counts per
                    # stream, so within a millisecond the deeper stream goes first (a
                    # child's end and the settling of its call in the parent are one
                    # script, the child's end first).
                    ms = stream_pos(q[0].stream_id or "0-0")[0]
                    heads.append((ms, -len(self.streams[t].path), order[t], t))
            if not heads:
                break
            t = min(heads)[3]
            known = len(self.streams)
            yield from self.emit(self.streams[t], pending[t].popleft())
            if len(self.streams) > known:
                return list(self.streams)[known:]
        return []


class TreeFollower(Relay):
    """One follow of a turn and, `depth` levels down, of the sub-agents it starts."""

    def __init__(self, bus: EventBus, root: str, *, after: Cursor, depth: int) -> None:
        super().__init__(root, after=after, depth=depth)
        self.redis: redis.Redis = bus.redis  # type: ignore[assignment]
        self.bus = bus
        self.marks: dict[str, int] = {}
        """How often this follower counted itself in each open stream's `watchers`: a turn
        publishes its live copies only while someone does."""
        self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        self.broken = False
        """The shard subscription was lost (a Cluster node failed) and is not back yet."""
        self.resubscribed = False
        """Subscribed again after a loss: what was published meanwhile is only in the logs."""
        self.opened(root)
        self.resume(self.redis, after)

    def opened(self, turn_id: str) -> None:
        # Counted in before subscribing, so every live copy published after the log read
        # that follows reaches the subscription; a turn not created yet is counted in at a
        # later catch-up (`remark`).
        self.remark(turn_id)
        self._listen("subscribe", [turn_id])

    def closed(self, turn_ids: list[str]) -> None:
        self._listen("unsubscribe", turn_ids)
        self._unmark(turn_ids)

    def _listen(self, verb: str, turn_ids: list[str]) -> None:
        """(Un)subscribe the turns' channels: shard channels on a Cluster."""
        method = getattr(self.pubsub, "s" + verb if self.bus.sharded else verb)
        method(*(turn_key(t, "events") for t in turn_ids))

    def _unmark(self, turn_ids: list[str]) -> None:
        for t in turn_ids:
            n = self.marks.pop(t, 0)
            if n:
                # A follower that dies without this leaves the turn publishing live copies
                # to nobody: a cost, not a fault.
                with contextlib.suppress(redis.RedisError):
                    self.bus.watch(t, -n)

    def remark(self, turn_id: str) -> None:
        """Count in again where the count may be gone (a failover lost it, or the turn did
        not exist yet): its events came by the log, not live."""
        self.marks[turn_id] = self.marks.get(turn_id, 0) + int(self.bus.watch(turn_id, 1))

    def catch_up(self, streams: list[_Stream] | None = None) -> Iterator[Event]:
        """Everything the logs hold past each stream's position (`streams`, or all), merged."""
        pending: dict[str, deque[Event]] = {}
        full: set[str] = set()
        need = [s.turn_id for s in streams] if streams is not None else list(self.streams)
        while need:
            for t in need:
                pending[t] = deque(self.bus.replay(t, self.streams[t].last_id, PAGE))
            full = (full - set(need)) | {t for t in need if len(pending[t]) >= PAGE}
            need = yield from self.merge(pending, full)

    def live(self, ev: Event) -> Iterator[Event]:
        """A live copy from the subscription; a gap in its stream's seq is refilled."""
        stream = self.streams.get(ev.turn_id)
        if stream is None or not _is_new(ev, stream.last_seq, stream.last_id):
            return
        if ev.seq != stream.last_seq + 1:
            yield from self.catch_up([stream])
            return
        known = len(self.streams)
        yield from self.emit(stream, ev)
        if len(self.streams) > known:
            # Subscribed when opened, so its log and then its live copies miss nothing.
            # Every stream's log, not only its: what the parent published before the
            # child began (the call's tool_started) may still wait in the subscription,
            # behind this message, and the merge puts it before the child's events.
            yield from self.catch_up()

    def message(self, timeout_s: float) -> dict[str, Any] | None:
        if not self.bus.sharded:
            # A plain PubSub reconnects and subscribes again by itself.
            return self.pubsub.get_message(timeout=timeout_s)  # type: ignore[no-any-return]
        try:
            if self.broken:
                with contextlib.suppress(Exception):
                    self.pubsub.close()
                # A command on each turn's slot makes the client learn who serves it now.
                for t in self.streams:
                    self.redis.exists(turn_key(t))
                self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                self._listen("subscribe", list(self.streams))
                self.broken = False
                self.resubscribed = True
            return self.pubsub.get_sharded_message(timeout=timeout_s)  # type: ignore[no-any-return]
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException) as exc:
            # A shard subscription dies with its node; once a replica serves the slot, it
            # is made again, and the logs fill in what it missed.
            if not self.broken:
                log.warning("event subscription lost (%s); subscribing again", exc)
            self.broken = True
            time.sleep(min(timeout_s, 0.25))
            return None

    def close(self) -> None:
        self.pubsub.close()
        self._unmark(list(self.marks))


def follow(
    bus: EventBus,
    turn_id: str,
    *,
    after: Cursor | str = "0-0",
    depth: int = 0,
    heartbeat_s: float | None = None,
    live: bool = True,
) -> Generator[Event | None, None, None]:
    """Yield every event after `after` exactly once: the logs first, then (`live`) live.

    Subscribes before reading a log so nothing published in between is lost, and drops
    live copies already seen in the log. A seq gap on the live side (a missed message) is
    filled from the log, which a silent follower also re-reads every CATCH_UP_S. Yields
    None every `heartbeat_s` of silence, so callers can write keep-alives or notice a
    gone client. Each event's `cursor` resumes right after it.
    """
    cursor = Cursor.parse(after) if isinstance(after, str) else after
    tree = TreeFollower(bus, turn_id, after=cursor, depth=depth)
    try:
        yield from tree.catch_up()
        if not live:
            return
        beat_at = caught_up_at = time.monotonic()
        while not tree.done:
            wait_s = 1.0 if heartbeat_s is None else min(1.0, heartbeat_s)
            msg = tree.message(wait_s)
            now = time.monotonic()
            if msg is not None:
                yield from tree.live(Event.parse(msg["data"]))
                continue
            if heartbeat_s is not None and now - beat_at >= heartbeat_s:
                beat_at = now
                yield None
            # A live copy published while the subscription was reconnecting is only in
            # the log: look there now and then, or a quiet turn's last event would never
            # arrive.
            if now - caught_up_at >= CATCH_UP_S or tree.resubscribed:
                caught_up_at = now
                tree.resubscribed = False
                came: set[str] = set()
                for ev in tree.catch_up():
                    came.add(ev.turn_id)
                    yield ev
                for t in list(tree.streams):
                    if t in came or not tree.marks.get(t):
                        tree.remark(t)
    finally:
        tree.close()


def _is_new(ev: Event, last_seq: int, last_id: str) -> bool:
    """Whether `ev` comes after what was yielded: by stream id, else by seq.

    Stream ids keep growing even when Redis lost the log (a restart without
    persistence) and seq began again at 1, so the turn's last word still gets through.
    """
    if ev.stream_id is None:
        return ev.seq > last_seq
    return stream_pos(ev.stream_id) > stream_pos(last_id)


def stream_pos(stream_id: str) -> tuple[int, int]:
    """(ms, seq) of a stream id, to order ids by; (0, 0) for one that is not a stream id."""
    return parse_stream_id(stream_id) or (0, 0)


def _norm(stream_id: str) -> str:
    return "{}-{}".format(*stream_pos(stream_id))
