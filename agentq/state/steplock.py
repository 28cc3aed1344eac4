"""A turn's step: its lock, the fenced commit of what it decided, and its wakeups."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from redis.commands.core import Script

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD, ended_lua, event_body, publish_lua
from agentq.models import ToolResult
from agentq.state.base import (
    WAKE_BACKSTOP_S,
    RoundRead,
    StepView,
    StoreBase,
    dispatch_args,
    each_shard,
    now_ms,
    plan_args,
    step_view,
    text,
)
from agentq.state.lua import (
    LOCK_FREE_VALUE,
    TURN_OPEN_LUA,
    append_lua,
    hset_table_lua,
    lock_free_lua,
    lock_mine_lua,
    lock_value_lua,
    view_lua,
    wake_lua,
)

_STEP, _DIRTY = k.STEP_FIELD, k.DIRTY_FIELD

# A woken turn: whoever wakes it (a model round, an answer) in one step.
WAKE_ONLY_LUA = (
    TURN_OPEN_LUA % (1, 0) + wake_lua("KEYS[1]", "KEYS[2]", "ARGV[1]", "ARGV[2]") + "return 1"
)


# What a fenced write reads first: the step lock, whether the token still holds it (else
# `refused` is returned), and `watchers`, `seq`, `dirty` and `hlen` for what it writes next.
def _fence_lua(refused: int) -> str:
    return f"""
local open = redis.call('HMGET', KEYS[1], '{_STEP}', '{WATCHERS_FIELD}', '{SEQ_FIELD}', '{_DIRTY}',
  '{k.UNSETTLED_FIELD}', 'status', '{k.HISTORY_LEN_FIELD}')
if not {lock_mine_lua("open[1]", "ARGV[1]")} then return {refused} end
local watchers, seq, dirty = open[2], tonumber(open[3]) or 0, tonumber(open[4]) == 1
local unsettled, status, hlen = tonumber(open[5]) or 0, open[6], tonumber(open[7]) or 0
"""


def _fields_and_events_lua(log: str, channel: str, fields: str, first: str, opts: str) -> str:
    """Lua that puts the state fields ARGV[fields..a - 1] (`a` a local) in the table `w`,
    publishes the `ne` (a local) event bodies from ARGV[first] on, and puts the turn's new
    seq in `w` too: the script writes `w` in one HSET."""
    return (
        f"""
local w = {{}}
for i = {fields}, a - 1 do w[#w + 1] = ARGV[i] end
if ne > 0 then
  for i = {first}, {first} + ne - 1 do
"""
        + publish_lua(log, channel, "ARGV[i]", opts, "watchers")
        + f"""
  end
  w[#w + 1] = '{SEQ_FIELD}'
  w[#w + 1] = seq
end
"""
    )


# The step's writes are fenced by its lock token: a step whose lock lapsed (a paused
# process) cannot overwrite what the step that took over wrote. With them, in the same
# write: the plans of calls just asked for, and the events the change means, so that an
# event is never seen without its state nor a step's state without its event.
COMMIT_LUA = (
    _fence_lua(0)
    + """
local nf, na, np, ne = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local a = 7 + 2 * nf
"""
    + _fields_and_events_lua("KEYS[2]", "KEYS[3]", "7", "a + na + 2 * np", "ARGV[6]")
    + """
for i = a + na, a + na + 2 * np - 1 do w[#w + 1] = ARGV[i] end
"""
    + append_lua("w", "a", "a + na - 1")
    + hset_table_lua("KEYS[1]", "w")
    + "return 1\n"
)

# A step begins: take the lock (free, or lapsed), clear the dirty mark, and read what the
# step needs (state with its cancel reason, history, round) in one round trip. A turn
# Redis does not hold is read as such, and nothing is written to it.

BEGIN_LUA = f"""
local st = redis.call('HGETALL', KEYS[1])
if #st == 0 then return {{{{}}, {{}}, {{}}}} end
local held = false
for i = 1, #st, 2 do if st[i] == '{_STEP}' then held = st[i + 1] end end
if not {lock_free_lua("held", "ARGV[3]")} then return false end
local lock = {lock_value_lua("ARGV[1]", "ARGV[3]", "ARGV[2]")}
redis.call('HSET', KEYS[1], '{_STEP}', lock, '{_DIRTY}', 0)
return {view_lua("st")}
"""

# A step that goes round again (woken while it ran) reads afresh, lock kept.
REREAD_LUA = f"""
local st = redis.call('HGETALL', KEYS[1])
local held = false
for i = 1, #st, 2 do if st[i] == '{_STEP}' then held = st[i + 1] end end
if not {lock_mine_lua("held", "ARGV[1]")} then return false end
redis.call('HSET', KEYS[1], '{_DIRTY}', 0)
return {view_lua("st")}
"""

# Releasing the step lock, with what the step staged (history messages, state fields and
# their events, call plans) and the dispatch records of the calls it is about to send:
# a step's sends are its last act, after this write, so a call's start and result always
# find its record, and its events follow the turn's. `counted` (ARGV[10]) of the records
# are of calls sent for the first time, which the batch in flight gains. If the turn was
# woken meanwhile, keep the lock (for a full term) and step again; else let go of it and
# leave the turn's next deadline for the sweepers.
RELEASE_LUA = (
    _fence_lua(-1)
    + """
local nf, ne, na = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[9])
local counted = tonumber(ARGV[10])
local a = 11 + 2 * nf
"""
    + _fields_and_events_lua("KEYS[3]", "KEYS[4]", "11", "a + na", "ARGV[7]")
    + f"""
for i = a + na + ne, #ARGV do w[#w + 1] = ARGV[i] end
if counted > 0 then
  w[#w + 1] = '{k.UNSETTLED_FIELD}'
  w[#w + 1] = unsettled + counted
end
w[#w + 1] = '{_STEP}'
w[#w + 1] = dirty and {lock_value_lua("ARGV[1]", "ARGV[8]", "ARGV[4]")} or '{LOCK_FREE_VALUE}'
"""
    + append_lua("w", "a", "a + na - 1")
    + hset_table_lua("KEYS[1]", "w")
    + "\nif dirty then return 0 end\nif "
    + ended_lua("status")
    + """ then
  -- A step of a turn that had ended (a late delivery): it is not among the open ones.
  redis.call('ZREM', KEYS[2], ARGV[2])
else
  -- No deadline: the turn stays among the open ones, due never (a wake moves it).
  redis.call('ZADD', KEYS[2], ARGV[3] == '' and '+inf' or ARGV[3], ARGV[2])
end
return 1
"""
)

# A sweeper claims a due wakeup by pushing it later (its retry if the step never runs):
# several sweepers, one claim. The turn is marked woken, should a step hold it now.
CLAIM_LUA = f"""
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not cur) or tonumber(cur) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], '{_DIRTY}', 1) end
return 1
"""

# Taking the step lock alone (a caller that holds a turn still, such as a test).
LOCK_LUA = f"""
local h = redis.call('HMGET', KEYS[1], 'status', '{_STEP}')
if not h[1] or not {lock_free_lua("h[2]", "ARGV[3]")} then return 0 end
redis.call('HSET', KEYS[1], '{_STEP}', {lock_value_lua("ARGV[1]", "ARGV[3]", "ARGV[2]")})
return 1
"""


class StepRecords(StoreBase):
    """The step lock, the commit fenced by it, the round a step collects, and wakeups."""

    LUA: ClassVar[dict[str, str]] = {
        "_wake": WAKE_ONLY_LUA,
        "_commit": COMMIT_LUA,
        "_begin": BEGIN_LUA,
        "_reread": REREAD_LUA,
        "_release": RELEASE_LUA,
        "_claim": CLAIM_LUA,
        "_lock": LOCK_LUA,
    }
    _wake: Script
    _commit: Script
    _begin: Script
    _reread: Script
    _release: Script
    _claim: Script
    _lock: Script

    def lock_step(self, turn_id: str, token: str, ttl_ms: int) -> bool:
        """Take a turn's step lock (free or lapsed) for `ttl_ms`; False if held or no turn."""
        return bool(self._lock(keys=[k.turn_key(turn_id)], args=[token, ttl_ms, now_ms()]))

    def step_holder(self, turn_id: str) -> str | None:
        """The token of the step that holds the turn's lock now, if any."""
        raw = self.redis.hget(k.turn_key(turn_id), k.STEP_FIELD)
        token, _, until = str(json.loads(raw) if raw else "").rpartition(":")
        return token if token and until.isdigit() and int(until) > now_ms() else None

    def begin_step(
        self, turn_id: str, token: str, ttl_ms: int, *, again: bool = False
    ) -> StepView | None:
        """Lock the turn for a step (or keep the lock, `again`) and read it, in one round
        trip; None if another step holds it (or, `again`, this step lost it)."""
        script = self._reread if again else self._begin
        raw = script(
            keys=[k.turn_key(turn_id)],
            args=[token, ttl_ms, now_ms()],
        )
        if not raw:
            return None
        return step_view(*raw)

    def commit(
        self,
        turn_id: str,
        token: str,
        fields: Mapping[str, Any],
        append: list[dict[str, Any]] | None = None,
        *,
        plans: dict[str, str] | None = None,
        events: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> bool:
        """Write state fields, append history messages, store call plans (call id -> plan
        JSON) and publish events, in one write, if this step still holds the lock."""
        messages = [json.dumps(m) for m in append or []]
        plan_pairs = plan_args(plans or {})
        bodies = [event_body(turn_id, t, f) for t, f in events or []]
        args: list[Any] = [token, len(fields), len(messages), len(plan_pairs) // 2, len(bodies)]
        args.append(self.bus.log_arg() if bodies else "")
        for f, v in fields.items():
            args += [f, json.dumps(v)]
        args += [*messages, *plan_pairs, *bodies]
        # Not run again: a second run would append the messages twice.
        ok = self._durable(
            self._commit,
            keys=[
                k.turn_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
            ],
            args=args,
            again=False,
        )
        if ok:
            self.bus.counted(events or [])
        return bool(ok)

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
        new_calls: int = 0,
    ) -> int:
        """Let go of the step's lock, appending history messages, writing state `fields`
        and call `plans`, publishing `events` (what the step staged) and recording the
        calls it is about to send (`dispatched`; `new_calls` of them sent for the first
        time) while it still holds it: 1 released; 0 woken meanwhile, lock kept: step
        again; -1 the lock was lost (nothing written)."""
        fields = fields or {}
        bodies = [event_body(turn_id, t, f) for t, f in events or []]
        messages = [json.dumps(m) for m in append or []]
        args: list[Any] = [token, turn_id, "" if next_wake_at is None else repr(next_wake_at)]
        args += [ttl_ms, len(fields), len(bodies), self.bus.log_arg() if bodies else ""]
        args += [now_ms(), len(messages), new_calls]
        for f, v in fields.items():
            args += [f, json.dumps(v)]
        args += [*messages, *bodies, *plan_args(plans or {}), *dispatch_args(dispatched or {})]
        keys = [k.turn_key(turn_id), k.turn_wakeups_key(turn_id)]
        keys += [k.log_key(turn_id), k.events_channel(turn_id)]
        if not (dispatched or fields or bodies or messages or plans):
            return int(self._release(keys=keys, args=args))
        # Not sent again: a second run finds the lock gone (and would publish twice).
        # Records a failover loses are of calls a later step sends again, which their
        # start claims run once.
        released = int(self._durable(self._release, keys=keys, args=args, again=False))
        if released != -1:
            self.bus.counted(events or [])
        return released

    def wake(self, turn_id: str) -> bool:
        """Wake an open turn: mark it and send it a step; False if it has ended."""
        ok = self.wake_here(turn_id)
        if ok:
            self._send_step(turn_id)
        return ok

    def wake_here(self, turn_id: str) -> bool:
        """Mark an open turn woken, for a caller that steps it itself; False if it has ended."""
        return bool(
            self._wake(
                keys=[k.turn_key(turn_id), k.turn_wakeups_key(turn_id)],
                args=[turn_id, time.time() + WAKE_BACKSTOP_S],
            )
        )

    def wake_by(self, turn_id: str, at: float) -> None:
        """Bring a pending wakeup forward to `at` (its step could not be sent): none is added
        for a turn that has none, since that turn has ended."""
        self.redis.zadd(k.turn_wakeups_key(turn_id), {turn_id: at}, xx=True, lt=True)

    def due_wakeups(self, now: float, limit: int = 500) -> list[str]:
        """Turns whose wakeup is due, up to `limit` of each shard, in one round trip."""
        got = each_shard(
            self.redis,
            lambda p, s: p.zrangebyscore(k.wakeups_key(s), "-inf", now, start=0, num=limit),
        )
        return [text(t) for raw in got for t in raw]

    def claim_wakeup(self, turn_id: str, now: float, retry_s: float) -> bool:
        """Claim a due wakeup (one sweeper wins) and push it `retry_s` later as its retry."""
        return bool(
            self._claim(
                keys=[k.turn_wakeups_key(turn_id), k.turn_key(turn_id)],
                args=[turn_id, now, now + retry_s],
            )
        )

    def round_view(
        self, turn_id: str, call_ids: list[str]
    ) -> tuple[dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """Settled results and dispatch records of these calls, in one round trip."""
        _, settled, dispatched = self.round_plans_view(turn_id, call_ids, plans=False)
        return settled, dispatched

    def round_plans_view(
        self,
        turn_id: str,
        call_ids: list[str],
        *,
        plans: bool = True,
        read: RoundRead | None = None,
    ) -> tuple[list[bytes | None], dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """The stored plans (raw, in order), settled results and dispatch records of these
        calls: from `read` when it is of these calls, else in one round trip."""
        if not call_ids:
            return [], {}, {}
        if read is not None and list(read.ids) == call_ids:
            results, calls, raw_plans = read.results, read.calls, [read.plans]
        else:
            kinds = (k.SETTLED, k.DISPATCHED, k.PLANNED) if plans else (k.SETTLED, k.DISPATCHED)
            n = len(call_ids)
            got = self.redis.hmget(k.turn_key(turn_id), [p + c for p in kinds for c in call_ids])
            results, calls, raw_plans = got[:n], got[n : 2 * n], [got[2 * n :]]
        return (
            raw_plans[0] if plans else [],
            {
                c: ToolResult.model_validate_json(r)
                for c, r in zip(call_ids, results, strict=True)
                if r
            },
            {c: json.loads(d) for c, d in zip(call_ids, calls, strict=True) if d},
        )
