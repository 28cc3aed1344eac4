"""Publish a turn's events to its channel and log in one round trip; read its log
(`events.follow` follows it without gaps)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple

import redis
from redis.cluster import RedisCluster

from agentq.constants import WATCH_CHANNEL, shard_of, turn_key
from agentq.events import Event
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import TERMINAL_STATUSES

EventCount = Callable[[list[tuple[str, dict[str, Any]]]], None]
"""Counts published events (type, fields) in the fleet's metrics."""

# The seq lives in the turn's state hash and is spliced into the body as text, so no JSON
# is parsed inside Redis. The live copy goes out only while someone follows the turn (its
# `watchers` field): a PUBLISH to nobody is a command Redis runs all the same.

WATCHERS_FIELD: Final = "watchers"
"""Field of the turn's state hash: how many followers want the live copies."""
SEQ_FIELD: Final = "seq"
"""Field of the turn's state hash: the seq of its last event."""


def publish_lua(
    log: str, channel: str, body: str, opts: str, watched: str, seq: str = "seq"
) -> str:
    """The Lua that publishes one event, for embedding in larger atomic scripts: `opts` is
    a `log_arg`, `watched` the turn's `watchers` as read (false: none), `seq` a Lua local
    with the turn's last seq, counted up here and written back by the script."""
    return f"""
{seq} = {seq} + 1
local body = '{{"seq":' .. {seq} .. ',' .. string.sub({body}, 2)
local maxlen, sharded = string.match({opts}, '^(%d+)(s?)$')
local id = redis.call('XADD', {log}, 'MAXLEN', '~', maxlen, '*', 'e', body)
local watched = {watched}
if watched and tonumber(watched) > 0 then
  local live = '{{"stream_id":"' .. id .. '",' .. string.sub(body, 2)
  redis.call(sharded == 's' and 'SPUBLISH' or 'PUBLISH', {channel}, live)
end
"""


def ended_lua(status: str) -> str:
    """A Lua condition: `status` (a turn's `status` field, as stored: JSON) is terminal."""
    return " or ".join(f"{status} == '\"{s}\"'" for s in sorted(TERMINAL_STATUSES))


def _publish_many_lua(refused: str) -> str:
    """The events of many turns in one call: KEYS are three per turn (log, channel, hash),
    ARGV the `log_arg`, then per turn its event count and bodies; nothing of a turn is
    published while `refused` (a Lua condition on its `status`) holds. Returns the positions
    of the followed turns (the stream worker holds back the deltas of the others) and of
    the refused ones (-1 - position)."""
    return (
        bind_lua((), ("log_opts",), rest="turns")
        + f"""
local a = turns_at
local followed = {{}}
for t = 0, #KEYS / 3 - 1 do
  local log_key, channel, turn_key = KEYS[3 * t + 1], KEYS[3 * t + 2], KEYS[3 * t + 3]
  local n = tonumber(ARGV[a])
  local open = redis.call('HMGET', turn_key, 'status', '{WATCHERS_FIELD}', '{SEQ_FIELD}')
  local status, last = open[1], tonumber(open[3]) or 0
  if {refused} then
    followed[#followed + 1] = -1 - t
  else
    if open[2] and tonumber(open[2]) > 0 then followed[#followed + 1] = t end
    for i = 1, n do
"""
        + publish_lua("log_key", "channel", "ARGV[a + i]", "log_opts", "open[2]", "last")
        + f"""
    end
    redis.call('HSET', turn_key, '{SEQ_FIELD}', last)
  end
  a = a + 1 + n
end
return followed
"""
    )


# Nothing is published after a turn's terminal event (a stream worker's late deltas after
# an abort are refused here atomically), nor to a turn Redis lost: its seq would make half
# a turn, which `end_lost_turn` then could not end.
PUBLISH_MANY_LUA = _publish_many_lua(f"not status or {ended_lua('status')}")
# Only while the turn is queued (`turn_queued`): once its first step ran, it said
# `turn_started`, and a late `turn_queued` after it would tell a follower the opposite.
PUBLISH_QUEUED_LUA = _publish_many_lua("status ~= '\"queued\"'")


# The count is a hint, never below zero (a mark a failover lost, then taken back, leaves it
# short; `follow.Marks` marks again), and never creates a turn. A mark is told on
# WATCH_CHANNEL: the stream workers then stop holding the turn's deltas.
class WatchArgs(NamedTuple):
    by: int
    """1: a follower more; -1 (or less): fewer."""
    turn_id: str


WATCH_LUA = bind_lua(("turn_key",), WatchArgs) + (
    f"""
if redis.call('EXISTS', turn_key) == 0 then return false end
local n = redis.call('HINCRBY', turn_key, '{WATCHERS_FIELD}', by)
if n <= 0 then redis.call('HDEL', turn_key, '{WATCHERS_FIELD}') end
if tonumber(by) > 0 then redis.call('PUBLISH', '{WATCH_CHANNEL}', turn_id) end
return n
"""
)
PUBLISH_MANY_EVENTS = 100
"""Events per PUBLISH_MANY_LUA call: Redis runs a script alone, so a batch of a thousand
would hold every other client for milliseconds."""


def event_body(turn_id: str, type_: str, fields: dict[str, Any]) -> str:
    """An event as published, without its seq; `type` first (the counted prefixes read it)."""
    return json.dumps(
        {"type": type_, "turn_id": turn_id, "ts": round(time.time(), 6), **fields},
        separators=(",", ":"),
        default=str,
    )


def run_pipeline(client: Any, build: Callable[[Any], None]) -> list[Any]:
    """The answers of the commands `build` puts in a pipeline; built and sent again once
    if a retry took it to a new master that lacks its scripts (loaded before sending)."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        build(pipe)
        try:
            return list(pipe.execute())
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
    raise AssertionError("unreachable")


class EventBus:
    _publish_queued = LuaScript(PUBLISH_QUEUED_LUA)
    _publish_many = LuaScript(PUBLISH_MANY_LUA)
    _watch = LuaScript(WATCH_LUA)

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        log_maxlen: int = 10_000,
        count: EventCount | None = None,
        counted_types: frozenset[str] = frozenset(),
    ) -> None:
        self.redis = client
        self.log_maxlen = log_maxlen
        self.counted: EventCount = count or (lambda events: None)
        # How the bodies of counted events begin (`event_body` puts the type first).
        self._counted_prefixes = tuple(f'{{"type":"{t}"' for t in sorted(counted_types))
        self.sharded = isinstance(client, RedisCluster)
        """On a Cluster a turn's live copies go out by SPUBLISH: they stay on its shard."""

    def log_arg(self) -> str:
        """The publish scripts' options: the log's maxlen, then `s` on a Cluster (SPUBLISH)."""
        return f"{self.log_maxlen}s" if self.sharded else str(self.log_maxlen)

    def publish(self, turn_id: str, type_: str, **fields: Any) -> bool:
        """Publish one event; False if the turn has ended, or for a `turn_queued` once its
        first step ran."""
        script = self._publish_queued if type_ == "turn_queued" else self._publish_many
        over = self._send(script, {turn_id: [event_body(turn_id, type_, fields)]})[1]
        return not over

    def watch(self, turn_id: str, by: int) -> bool:
        """Count a follower in (`by` 1) or out (-1); False if Redis does not hold the turn."""
        args = WatchArgs(by, turn_id)
        return self._watch(keys=[turn_key(turn_id)], args=list(args)) is not None

    def publish_many(self, batches: Mapping[str, list[str]]) -> set[str]:
        """Publish several turns' `event_body`s in order; the turns someone followed."""
        return self._send(self._publish_many, batches)[0]

    def _send(self, script: Any, batches: Mapping[str, list[str]]) -> tuple[set[str], set[str]]:
        """Run a publish script on `batches` in calls of about PUBLISH_MANY_EVENTS events,
        each of one shard's turns on a Cluster; the turns followed, and those refused."""
        opts = self.log_arg()
        by_shard: dict[int, list[str]] = {}
        for turn_id, bodies in batches.items():
            if bodies:
                by_shard.setdefault(shard_of(turn_id) if self.sharded else 0, []).append(turn_id)
        calls: list[tuple[list[str], list[str], list[Any]]] = []
        for turn_ids in by_shard.values():
            calls.append(([], [], [opts]))
            for turn_id in turn_ids:
                if len(calls[-1][2]) > PUBLISH_MANY_EVENTS:
                    calls.append(([], [], [opts]))
                ids, keys, args = calls[-1]
                ids.append(turn_id)
                keys += [turn_key(turn_id, "log"), turn_key(turn_id, "events"), turn_key(turn_id)]
                args += [len(batches[turn_id]), *batches[turn_id]]
        if not calls:
            return set(), set()
        if len(calls) == 1 or self.sharded:
            # One script call: a pipeline would ask SCRIPT EXISTS first, every time. On a
            # Cluster one call after the other: redis-py's cluster pipeline refuses
            # scripts (it lost every batch that spanned shards).
            replies = [script(keys=keys, args=args) for _, keys, args in calls]
        else:

            def build(pipe: Any) -> None:
                for _, keys, args in calls:
                    script(keys=keys, args=args, client=pipe)

            replies = run_pipeline(self.redis, build)
        followed: set[str] = set()
        over: set[str] = set()
        for (ids, _, _), reply in zip(calls, replies, strict=True):
            for t in map(int, reply):
                (followed if t >= 0 else over).add(ids[t if t >= 0 else -1 - t])
        self.counted(
            [
                (str(event["type"]), event)
                for turn_id, bodies in batches.items()
                if turn_id not in over
                for body in bodies
                if self._counted_prefixes and body.startswith(self._counted_prefixes)
                for event in (json.loads(body),)
            ]
        )
        return followed, over

    def replay(self, turn_id: str, after_id: str = "0-0", count: int = 1000) -> list[Event]:
        """Events in the log strictly after `after_id`."""
        start = "(" + after_id if after_id not in ("0", "0-0", "-") else "-"
        entries: list[Any] = self.redis.xrange(turn_key(turn_id, "log"), start, "+", count)  # type: ignore[assignment]
        return [Event.parse(fields[b"e"], stream_id=eid.decode()) for eid, fields in entries]

    def log(self, turn_id: str, page: int = 1000) -> Iterator[Event]:
        """Every event in the turn's log, read `page` at a time."""
        after = "0-0"
        while True:
            chunk = self.replay(turn_id, after, count=page)
            yield from chunk
            if len(chunk) < page:
                return
            after = str(chunk[-1].stream_id)
