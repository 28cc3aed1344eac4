"""Lua fragments the store's scripts share; each whole script stands beside its method."""

from __future__ import annotations

from typing import Any

from agentq.constants import (
    CALL_RECORDS,
    CANCEL_FIELD,
    CHILDREN_FIELD,
    DIRTY_FIELD,
    DISPATCHED,
    HISTORY_LEN_FIELD,
    MESSAGE,
    PLANNED,
    SETTLED,
    STEP_FIELD,
    UNSETTLED_FIELD,
)
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD, ended_lua, publish_lua

_OPEN = (
    "status",
    WATCHERS_FIELD,
    CANCEL_FIELD,
    SEQ_FIELD,
    STEP_FIELD,
    UNSETTLED_FIELD,
    CHILDREN_FIELD,
    HISTORY_LEN_FIELD,
)


def turn_open_lua(ended: str, extra: tuple[str, ...] = ()) -> str:
    """Lua that reads the `_OPEN` fields of `turn_key` (and `more`, the fields `extra` names)
    and answers `ended` for a turn over or lost: nothing is written after its terminal
    event, and nothing recreates half of a vanished turn."""
    names = ", ".join([*(f"'{f}'" for f in _OPEN), *extra])
    return f"""local open = redis.call('HMGET', turn_key, {names})
local status, watched, cancelled = open[1], open[2], open[3]
local seq = tonumber(open[4]) or 0
local held, unsettled, kids = open[5], tonumber(open[6]) or 0, open[7]
local hlen = tonumber(open[8]) or 0
local more = {{}}
for i = 1, {len(extra)} do more[i] = open[{len(_OPEN)} + i] end
if not status or {ended_lua("status")} then
  return {ended}
end
"""


# The step lock is a state field (STEP_FIELD), handled in the commands a script runs on the
# state anyway. Its lifetime is on the caller's clock: a clock ahead may take a lock early,
# and the token still fences the step it took over.
def lock_free_lua(held: str) -> str:
    """A Lua condition: the step lock as read (`held`) is free ("" or lapsed) at `now_ms`."""
    return f"(not {held} or (tonumber(string.match({held}, ':(%d+)\"$')) or 0) <= tonumber(now_ms))"


def lock_mine_lua(held: str) -> str:
    """A Lua condition: the step lock as read (`held`) is the one the ARGV `token` took."""
    return f"({held} and string.match({held}, '^\"(.*):%d+\"$') == token)"


LOCK_VALUE_LUA = (
    """('"' .. token .. ':' .. string.format('%d', tonumber(now_ms) + tonumber(lock_ms)) .. '"')"""
)
"""A Lua expression: the step lock's value for the ARGV `token`, held `lock_ms` from `now_ms`."""


LOCK_FREE_VALUE = '""'
"""The step lock's value once let go (JSON, as every state field)."""


MANY_CHUNK = 1000
"""Values per HSET of `write_lua`: Lua's unpack refuses a few thousand at once."""


def write_lua(turn: str, w: str, first: str, last: str) -> str:
    """Lua that adds the messages ARGV[first..last] after the turn's `hlen` to the field/value
    table `w` and HSETs `w` to `turn` in MANY_CHUNK pieces."""
    return f"""
do
  local next_m = hlen
  for i = {first}, {last} do
    {w}[#{w} + 1] = '{MESSAGE}' .. string.format('%d', next_m)
    {w}[#{w} + 1] = ARGV[i]
    next_m = next_m + 1
  end
  if next_m > hlen then
    {w}[#{w} + 1] = '{HISTORY_LEN_FIELD}'
    {w}[#{w} + 1] = next_m
  end
end
for i = 1, #{w}, {MANY_CHUNK} do
  redis.call('HSET', {turn}, unpack({w}, i, math.min(i + {MANY_CHUNK - 1}, #{w})))
end
"""


_IS_RECORD_LUA = " or ".join(f"p == '{r}'" for r in CALL_RECORDS)
"""A Lua condition on `p`, a state field's first two characters: the field is a call's record."""


def wake_lua(fields: str = "", at: str = "wake_at") -> str:
    """Lua that marks a turn woken (one HSET with `fields`), due by `at` (LT: earlier stays)."""
    more = f", {fields}" if fields else ""
    return f"""
redis.call('HSET', turn_key, '{DIRTY_FIELD}', 1{more})
redis.call('ZADD', wakeups_key, 'LT', {at}, turn_id)
"""


def view_lua(st: str) -> str:
    """A Lua table: what a step reads of the state `st` (HGETALL): the state without records,
    the history, and the round's results, dispatch records and plans (no read of its own)."""
    return f"""(function()
    local state, rec, rc, hist = {{}}, {{}}, nil, {{}}
    for i = 1, #{st}, 2 do
      local f = {st}[i]
      local p = string.sub(f, 1, 2)
      if {_IS_RECORD_LUA} then
        rec[f] = {st}[i + 1]
      elseif p == '{MESSAGE}' then
        hist[tonumber(string.sub(f, 3)) + 1] = {st}[i + 1]
      else
        state[#state + 1] = f
        state[#state + 1] = {st}[i + 1]
        if f == 'round_calls' then rc = {st}[i + 1] end
      end
    end
    local rnd = {{}}
    local ids = rc and cjson.decode(rc)
    if type(ids) == 'table' and #ids > 0 then
      local n, open = #ids, false
      for i = 1, n do
        local id = tostring(ids[i])
        rnd[i] = rec['{SETTLED}' .. id] or false
        rnd[n + i] = rec['{DISPATCHED}' .. id] or false
        rnd[2 * n + i] = rec['{PLANNED}' .. id] or false
        open = open or not rnd[i]
      end
      -- Every call settled: the step sends nothing, and needs no dispatch record.
      if not open then for i = n + 1, 2 * n do rnd[i] = false end end
    end
    return {{state, hist, rnd}}
  end)()"""


def wake_or_step_lua(fields: str, stepped: int) -> str:
    """Lua that writes `fields` and wakes the turn or, for a caller that steps it (`token`)
    while the lock is free, takes the lock and answers `stepped` with its view, as BEGIN
    would: one round trip fewer. That step needs no dirty mark, only the wakeup if it dies."""
    return f"""
if token ~= '' and {lock_free_lua("held")} then
  redis.call('HSET', turn_key, '{STEP_FIELD}', {LOCK_VALUE_LUA}, {fields})
  redis.call('ZADD', wakeups_key, 'LT', wake_at, turn_id)
  local st = redis.call('HGETALL', turn_key)
  return {{{stepped:d}, unpack({view_lua("st")})}}
end
""" + wake_lua(fields)


def settle_lua(settled: Any) -> str:
    """Lua that settles a call with exactly one result, whoever settles it (calls.SETTLE_LUA,
    or turns.CLOSE_LUA on a child's parent); it answers `settled` (base.Settled)."""
    fields = f"'{SETTLED}' .. call_id, result, '{SEQ_FIELD}', seq, '{UNSETTLED_FIELD}', unsettled"
    return (
        turn_open_lua(f"{settled.TURN_GONE:d}", extra=(f"'{SETTLED}' .. call_id",))
        + f"""
if more[1] then return {settled.LOST:d} end
if deadline_ms ~= '' and tonumber(now_ms) >= tonumber(deadline_ms) then
  return {settled.EXPIRED:d}
end
-- Only the settle that completes the batch in flight (or of an untracked call) wakes the
-- turn: a round of a thousand calls takes one step. A call recorded as sent is counted.
if tracked == '1' then unsettled = math.max(unsettled - 1, 0) end
local ready = tracked ~= '1' or unsettled == 0
{publish_lua("log_key", "channel", "event", "log_opts", "watched")}
if not ready or wake ~= '1' then
  redis.call('HSET', turn_key, {fields})
  return ready and {settled.READY:d} or {settled.WON:d}
end
"""
        + wake_or_step_lua(fields, settled.READY)
        + f"return {settled.READY:d}\n"
    )
