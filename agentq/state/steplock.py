"""A turn's step: its lock, the fenced commit of what it decided, and its wakeups."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from enum import IntEnum
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD, ended_lua, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import ToolResult
from agentq.state.base import (
    WAKE_BACKSTOP_S,
    RoundRead,
    StepView,
    StoreBase,
    TurnKeys,
    dispatch_args,
    first_send,
    now_ms,
    step_view,
)
from agentq.state.lua import (
    LOCK_FREE_VALUE,
    LOCK_VALUE_LUA,
    lock_free_lua,
    lock_mine_lua,
    turn_open_lua,
    view_lua,
    wake_lua,
    write_lua,
)

_STEP, _DIRTY = k.STEP_FIELD, k.DIRTY_FIELD


class Released(IntEnum):
    """What `release_step` did (RELEASE_LUA answers it)."""

    LOST = -1
    """The step's token no longer holds the lock: nothing written."""
    WOKEN = 0
    """Written; the turn was woken meanwhile, so the lock is kept (a full term): step again."""
    RELEASED = 1
    """Written, the lock let go, the turn's next deadline left for the sweepers."""
    KEPT = 2
    """Written, the lock kept (`keep`: a commit of what the step decided so far)."""


class WakeArgs(NamedTuple):
    turn_id: str
    wake_at: float
    """When a sweeper steps the turn if its step message is lost."""


WAKE_ONLY_LUA = bind_lua(TurnKeys, WakeArgs) + turn_open_lua("0") + wake_lua() + "return 1"


class LockArgs(NamedTuple):
    token: str
    lock_ms: int
    now_ms: int
    """The caller's clock, on which the lock's lifetime runs."""
    again: str = "0"
    """"1": a woken step goes round again, keeping its lock; "lock": the lock alone (answers 1)."""


# BEGIN_LUA: take the lock (free or lapsed; or keep it, `again`), clear the dirty mark and
# read the step's view in one round trip; nothing is written to a turn Redis does not hold.
BEGIN_LUA = (
    bind_lua(("turn_key",), LockArgs)
    + f"""
local st = redis.call('HGETALL', turn_key)
local held = false
for i = 1, #st, 2 do if st[i] == '{_STEP}' then held = st[i + 1] end end
if again ~= '1' then
  if #st == 0 then return {{{{}}, {{}}, {{}}}} end
  if not {lock_free_lua("held")} then return false end
  held = {LOCK_VALUE_LUA}
elseif not {lock_mine_lua("held")} then
  return false
end
if again == 'lock' then
  redis.call('HSET', turn_key, '{_STEP}', held)
  return 1
end
redis.call('HSET', turn_key, '{_STEP}', held, '{_DIRTY}', 0)
return {view_lua("st")}
"""
)


class ReleaseArgs(NamedTuple):
    token: str
    """The step's lock token: the fence."""
    turn_id: str
    next_at: str
    """The turn's next deadline (epoch seconds; "": none, only a wake moves it)."""
    lock_ms: int
    """A lock kept (the turn was woken meanwhile) is kept this long."""
    log_opts: str
    """`EventBus.log_arg()` ("" without events)."""
    now_ms: int
    new_calls: int
    """How many of the dispatch records are of calls sent for the first time."""
    keep: str
    """"1": a commit: the write alone, the lock and the turn's wakeup left as they are."""
    n_fields: int
    """The lengths of the ARGV sections that follow, in order: state field/value pairs, plan
    field/CallPlan pairs, messages appended, event bodies; then the dispatch records' pairs."""
    n_plans: int
    n_messages: int
    n_events: int


# RELEASE_LUA: a step's writes are fenced by its lock token (a paused process whose lock
# lapsed cannot overwrite its successor's), with its plans and events in the same write: no
# event without its state. Unless it `keep`s the lock, it lets go and writes the dispatch
# records of its sends, its last act, so a call's start and result find its record.
RELEASE_LUA = (
    bind_lua(TurnKeys, ReleaseArgs, rest="sections")
    + f"""
local open = redis.call('HMGET', turn_key, '{_STEP}', '{WATCHERS_FIELD}', '{SEQ_FIELD}',
  '{_DIRTY}', '{k.UNSETTLED_FIELD}', 'status', '{k.HISTORY_LEN_FIELD}')
if not {lock_mine_lua("open[1]")} then return {Released.LOST:d} end
local watchers, seq, dirty = open[2], tonumber(open[3]) or 0, tonumber(open[4]) == 1
local unsettled, status, hlen = tonumber(open[5]) or 0, open[6], tonumber(open[7]) or 0
local ne = tonumber(n_events)
local messages_at = sections_at + tonumber(n_fields) + tonumber(n_plans)
local events_at = messages_at + tonumber(n_messages)
local records_at = events_at + ne
local w = {{}}
for i = sections_at, messages_at - 1 do w[#w + 1] = ARGV[i] end
if ne > 0 then
  for i = events_at, records_at - 1 do
{publish_lua("log_key", "channel", "ARGV[i]", "log_opts", "watchers")}
  end
  w[#w + 1] = '{SEQ_FIELD}'
  w[#w + 1] = seq
end
if keep ~= '1' then
  for i = records_at, #ARGV do w[#w + 1] = ARGV[i] end
  local counted = tonumber(new_calls)
  if counted > 0 then
    w[#w + 1] = '{k.UNSETTLED_FIELD}'
    w[#w + 1] = unsettled + counted
  end
  w[#w + 1] = '{_STEP}'
  w[#w + 1] = dirty and {LOCK_VALUE_LUA} or '{LOCK_FREE_VALUE}'
end
{write_lua("turn_key", "w", "messages_at", "events_at - 1")}
if keep == '1' then return {Released.KEPT:d} end
if dirty then return {Released.WOKEN:d} end
if {ended_lua("status")} then
  -- A step of a turn that had ended (a late delivery): it is not among the open ones.
  redis.call('ZREM', wakeups_key, turn_id)
else
  -- No deadline: the turn stays among the open ones, due never (a wake moves it).
  redis.call('ZADD', wakeups_key, next_at == '' and '+inf' or next_at, turn_id)
end
return {Released.RELEASED:d}
"""
)


class ClaimArgs(NamedTuple):
    turn_id: str
    now: float
    retry_at: float
    """When the wakeup is due again, should the step it claims never run."""


# CLAIM_LUA: a sweeper claims a due wakeup by pushing it to its retry: several sweepers, one
# claim. The turn is marked woken, should a step hold it now.
CLAIM_LUA = (
    bind_lua(TurnKeys, ClaimArgs)
    + f"""
local cur = redis.call('ZSCORE', wakeups_key, turn_id)
if (not cur) or tonumber(cur) > tonumber(now) then return 0 end
redis.call('ZADD', wakeups_key, retry_at, turn_id)
if redis.call('EXISTS', turn_key) == 1 then redis.call('HSET', turn_key, '{_DIRTY}', 1) end
return 1
"""
)


class StepRecords(StoreBase):
    """The step lock, the commit fenced by it, the round a step collects, and wakeups."""

    _wake = LuaScript(WAKE_ONLY_LUA)
    _begin = LuaScript(BEGIN_LUA)
    _release = LuaScript(RELEASE_LUA)
    _claim = LuaScript(CLAIM_LUA)

    def lock_step(self, turn_id: str, token: str, ttl_ms: int) -> bool:
        """Take a turn's step lock (free or lapsed) for `ttl_ms`; False if held or no turn."""
        args = LockArgs(token, ttl_ms, now_ms(), "lock")
        return bool(self._begin(keys=[k.turn_key(turn_id)], args=list(args)) == 1)

    def begin_step(
        self, turn_id: str, token: str, ttl_ms: int, *, again: bool = False
    ) -> StepView | None:
        """Lock the turn for a step (or keep it, `again`) and read it; None if another holds it."""
        args = LockArgs(token, ttl_ms, now_ms(), "1" if again else "0")
        raw = self._begin(keys=[k.turn_key(turn_id)], args=list(args))
        return step_view(*raw) if raw else None

    def release_step(
        self,
        turn_id: str,
        token: str,
        next_wake_at: float | None,
        ttl_ms: int,
        dispatched: dict[str, dict[str, Any]] | None = None,
        *,
        fields: Mapping[str, Any] | None = None,
        events: list[tuple[str, dict[str, Any]]] | None = None,
        append: list[dict[str, Any]] | None = None,
        plans: dict[str, str] | None = None,
        keep: bool = False,
    ) -> Released:
        """Write what the step staged and its sends' records, fenced; let go unless `keep`."""
        sections = (
            [x for f, v in (fields or {}).items() for x in (f, json.dumps(v))],
            [x for c, p in (plans or {}).items() for x in (k.PLANNED + c, p)],
            [json.dumps(m) for m in append or []],
            [event_body(turn_id, t, f) for t, f in events or []],
        )
        dispatched = dispatched or {}
        named = ReleaseArgs(
            token,
            turn_id,
            "" if next_wake_at is None else repr(next_wake_at),
            ttl_ms,
            self.bus.log_arg() if events else "",
            now_ms(),
            sum(1 for r in dispatched.values() if first_send(r)),
            "1" if keep else "0",
            *map(len, sections),
        )
        args: list[Any] = [*named, *(x for s in sections for x in s), *dispatch_args(dispatched)]
        keys = TurnKeys.of(turn_id)
        if not (dispatched or any(sections)):
            return Released(int(self._release(keys=keys, args=args)))
        # Not sent again: a second run finds the lock gone or appends (and publishes) twice.
        # Records a failover loses are sent again by a later step; start claims run them once.
        released = Released(int(self._durable(self._release, keys=keys, args=args, again=False)))
        if released is not Released.LOST:
            self.bus.counted(events or [])
        return released

    def wake(self, turn_id: str) -> bool:
        """Wake an open turn: mark it and send it a step; False if it has ended."""
        args = WakeArgs(turn_id, time.time() + WAKE_BACKSTOP_S)
        ok = bool(self._wake(keys=TurnKeys.of(turn_id), args=list(args)))
        if ok:
            self.send_step(turn_id)
        return ok

    def wake_by(self, turn_id: str, at: float) -> None:
        """Bring a wakeup forward to `at` (its step could not be sent); an ended turn has none."""
        self.redis.zadd(k.shard_key(k.WAKEUPS, turn_id), {turn_id: at}, xx=True, lt=True)

    def claim_wakeup(self, turn_id: str, now: float, retry_s: float) -> bool:
        """Claim a due wakeup (one sweeper wins) and push it `retry_s` later as its retry."""
        args = ClaimArgs(turn_id, now, now + retry_s)
        return bool(self._claim(keys=TurnKeys.of(turn_id), args=list(args)))

    def round_view(
        self, turn_id: str, call_ids: list[str], *, read: RoundRead | None = None
    ) -> tuple[list[bytes | None], dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """The plans (raw), results and dispatch records of these calls, from `read` if theirs."""
        if not call_ids:
            return [], {}, {}
        n, kinds = len(call_ids), (k.SETTLED, k.DISPATCHED, k.PLANNED)
        if read is not None and list(read.ids) == call_ids:
            got = read.values
        else:
            got = self.redis.hmget(k.turn_key(turn_id), [p + c for p in kinds for c in call_ids])
        results = zip(call_ids, got[:n], strict=True)
        calls = zip(call_ids, got[n : 2 * n], strict=True)
        return (
            got[2 * n :],
            {c: ToolResult.model_validate_json(r) for c, r in results if r},
            {c: json.loads(d) for c, d in calls if d},
        )
