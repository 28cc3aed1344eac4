"""Publish a turn's events to its channel and log in one round trip; read its log
(`events.follow` follows it without gaps)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import redis

from agentq.constants import (
    MEASURED_EVENT_TYPES,
    MEASURED_EVENTS_CHANNEL,
    events_channel,
    log_key,
    seq_key,
    turn_key,
)
from agentq.models import TERMINAL_STATUSES, Event

# Appends to the log and publishes with the same seq, atomically: a subscriber that
# reads the log after subscribing can dedupe by seq and never misses an event.
# ARGV[1] is the event JSON without seq; the script splices seq (and, for the live
# copy, the stream id) in as text so no JSON is parsed inside Redis.


# A body starts with its type (`event_body`): the gateways' metrics read only the types
# they count from one channel, not every delta of every turn through a pattern.
_MEASURED_LUA = " or ".join(f"etype == '{t}'" for t in MEASURED_EVENT_TYPES)


def publish_lua(seq: str, log: str, channel: str, body: str, maxlen: str) -> str:
    """The Lua that publishes one event, for embedding in larger atomic scripts."""
    return f"""
local seq = redis.call('INCR', {seq})
local body = '{{"seq":' .. seq .. ',' .. string.sub({body}, 2)
local id = redis.call('XADD', {log}, 'MAXLEN', '~', {maxlen}, '*', 'e', body)
local live = '{{"stream_id":"' .. id .. '",' .. string.sub(body, 2)
redis.call('PUBLISH', {channel}, live)
local etype = string.match({body}, '^{{"type":"([%w_]+)"')
if {_MEASURED_LUA} then
  redis.call('PUBLISH', '{MEASURED_EVENTS_CHANNEL}', live)
end
"""


def ended_lua(status: str) -> str:
    """A Lua condition: `status` (a turn's `status` field, as stored: JSON) is terminal."""
    return " or ".join(f"{status} == '\"{s}\"'" for s in sorted(TERMINAL_STATUSES))


# Nothing is published after a turn's terminal event (the terminal event itself is
# published by the script that ends the turn): a late writer, such as a stream worker
# finishing its deltas after an abort, is refused here atomically.
PUBLISH_LUA = (
    f"""
local status = redis.call('HGET', KEYS[4], 'status')
if {ended_lua("status")} then
  return {{0, ''}}
end
"""
    + publish_lua("KEYS[1]", "KEYS[2]", "KEYS[3]", "ARGV[1]", "ARGV[2]")
    + "return {seq, id}"
)

# The events of many turns in one call: KEYS are four per turn (as for PUBLISH_LUA), ARGV
# the log's maxlen, then for each turn the number of its events and their bodies. One
# call instead of one per event: a stream worker publishes thousands of deltas a second.
PUBLISH_MANY_LUA = (
    f"""
local a = 2
for t = 0, #KEYS / 4 - 1 do
  local n = tonumber(ARGV[a])
  local status = redis.call('HGET', KEYS[4 * t + 4], 'status')
  if {ended_lua("status")} then
    a = a + 1 + n
  else
    for i = 1, n do
"""
    + publish_lua("KEYS[4 * t + 1]", "KEYS[4 * t + 2]", "KEYS[4 * t + 3]", "ARGV[a + i]", "ARGV[1]")
    + """
    end
    a = a + 1 + n
  end
end
return 1
"""
)
PUBLISH_MANY_EVENTS = 100
"""Events per PUBLISH_MANY_LUA call: Redis runs a script alone, so a batch of a thousand
would hold every other client for milliseconds."""

TERMINAL_TYPES = frozenset({"turn_finished", "turn_aborted", "turn_error"})


def event_body(turn_id: str, type_: str, fields: dict[str, Any]) -> str:
    """An event as published, without its seq; `type` first (the publish scripts read it)."""
    return json.dumps(
        {"type": type_, "turn_id": turn_id, "ts": round(time.time(), 6), **fields},
        separators=(",", ":"),
        default=str,
    )


class EventBus:
    def __init__(self, client: redis.Redis, *, log_maxlen: int = 10_000) -> None:
        self.redis = client
        self.log_maxlen = log_maxlen
        self._publish = client.register_script(PUBLISH_LUA)
        self._publish_many = client.register_script(PUBLISH_MANY_LUA)

    def publish(self, turn_id: str, type_: str, **fields: Any) -> int:
        """Publish one event; return its seq, 0 if the turn has ended (nothing published)."""
        res = self._publish(
            keys=[seq_key(turn_id), log_key(turn_id), events_channel(turn_id), turn_key(turn_id)],
            args=[event_body(turn_id, type_, fields), self.log_maxlen],
        )
        return int(res[0])

    def publish_many(self, batches: Mapping[str, list[str]], *, client: Any = None) -> None:
        """Publish event bodies (`event_body`) of several turns, each turn's in order, in
        calls of about PUBLISH_MANY_EVENTS events (on `client`, e.g. a pipeline)."""
        keys: list[str] = []
        args: list[Any] = [self.log_maxlen]
        for turn_id, bodies in batches.items():
            if not bodies:
                continue
            keys += [seq_key(turn_id), log_key(turn_id), events_channel(turn_id), turn_key(turn_id)]
            args += [len(bodies), *bodies]
            if len(args) > PUBLISH_MANY_EVENTS:
                self._publish_many(keys=keys, args=args, client=client)
                keys, args = [], [self.log_maxlen]
        if keys:
            self._publish_many(keys=keys, args=args, client=client)

    def replay(self, turn_id: str, after_id: str = "0-0", count: int = 1000) -> list[Event]:
        """Events in the log strictly after `after_id`."""
        start = "(" + after_id if after_id not in ("0", "0-0", "-") else "-"
        entries: list[Any] = self.redis.xrange(log_key(turn_id), min=start, max="+", count=count)  # type: ignore[assignment]
        return [Event.parse(fields[b"e"], stream_id=_s(eid)) for eid, fields in entries]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
