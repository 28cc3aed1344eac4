"""A turn's step: its lock, the fenced commit of what it decided, and its wakeups."""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar

from redis.commands.core import Script

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD, event_body, publish_lua
from agentq.models import ToolResult
from agentq.state.base import (
    WAKE_BACKSTOP_S,
    RoundRead,
    StepView,
    StoreBase,
    dispatch_args,
    each_shard,
    step_view,
    text,
)
from agentq.state.lua import (
    TURN_OPEN_LUA,
    hset_seq_lua,
    many_lua,
    read_view_lua,
    record_lua,
    wake_lua,
)

# A woken turn: whoever wakes it (a model round, an answer) in one step.
WAKE_ONLY_LUA = (
    TURN_OPEN_LUA % (3, 0)
    + wake_lua("KEYS[1]", "KEYS[2]", "ARGV[1]", "ARGV[2]", "ARGV[3]")
    + "return 1"
)


def _fields_and_events_lua(
    turn: str, log: str, channel: str, fields: str, first: str, opts: str
) -> str:
    """Lua that writes the state fields ARGV[fields..a - 1] (`a` a local) and publishes the
    `ne` (a local) event bodies from ARGV[first] on: with events, the fields and the turn's
    new seq are one HSET."""
    return (
        f"""
if ne > 0 then
  local open = redis.call('HMGET', {turn}, '{WATCHERS_FIELD}', '{SEQ_FIELD}')
  local watchers, seq = open[1], tonumber(open[2]) or 0
  for i = {first}, {first} + ne - 1 do
"""
        + publish_lua(log, channel, "ARGV[i]", opts, "watchers")
        + """
  end
"""
        + hset_seq_lua(turn, fields, "a - 1")
        + """
else
"""
        + many_lua("HSET", turn, fields, "a - 1")
        + """
end
"""
    )


# The step's writes are fenced by its lock token: a step whose lock lapsed (a paused
# process) cannot overwrite what the step that took over wrote. With them, in the same
# write: the plans of calls just asked for, and the events the change means, so that an
# event is never seen without its state nor a step's state without its event.
COMMIT_LUA = (
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local nf, na, np, ne = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local a = 7 + 2 * nf
"""
    + many_lua("RPUSH", "KEYS[3]", "a", "a + na - 1")
    + many_lua("HSET", "KEYS[4]", "a + na", "a + na + 2 * np - 1")
    + _fields_and_events_lua("KEYS[2]", "KEYS[5]", "KEYS[6]", "7", "a + na + 2 * np", "ARGV[6]")
    + "return 1\n"
)

# A step begins: take the lock, clear the dirty mark, and read what the step needs (state
# with its cancel reason, history) in one round trip.
_ROUND_KEYS = ("KEYS[5]", "KEYS[6]", "KEYS[7]")

BEGIN_LUA = f"""
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
redis.call('DEL', KEYS[2])
return {{{read_view_lua("KEYS[3]", "KEYS[4]", _ROUND_KEYS)}}}
"""

# A step that goes round again (woken while it ran) reads afresh, lock kept.
REREAD_LUA = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
redis.call('DEL', KEYS[2])
return {{{read_view_lua("KEYS[3]", "KEYS[4]", _ROUND_KEYS)}}}
"""

# Releasing the step lock, with what the step staged (state fields and their events) and
# the dispatch records of the calls it sent: a step that sent a model round writes its
# send here, after the message went out, not in a write of its own before (a delivery
# that comes before this write finds the turn locked, marks it woken, and the step reads
# again). If the turn was woken meanwhile, keep the lock and step again; else drop it
# and leave the turn's next deadline for the sweepers.
RELEASE_LUA = (
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local nf, ne = tonumber(ARGV[5]), tonumber(ARGV[6])
local a = 8 + 2 * nf
"""
    + _fields_and_events_lua("KEYS[7]", "KEYS[8]", "KEYS[9]", "8", "a", "ARGV[7]")
    + record_lua("KEYS[4]", "KEYS[5]", "KEYS[6]", "a + ne")
    + """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[3], ARGV[2])
else
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
end
return 1
"""
)

# A sweeper claims a due wakeup by pushing it later (its retry if the step never runs):
# several sweepers, one claim.
CLAIM_LUA = """
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not cur) or tonumber(cur) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
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
    }
    _wake: Script
    _commit: Script
    _begin: Script
    _reread: Script
    _release: Script
    _claim: Script

    def lock_step(self, turn_id: str, token: str, ttl_ms: int) -> bool:
        return bool(self.redis.set(k.step_lock_key(turn_id), token, nx=True, px=ttl_ms))

    def begin_step(
        self, turn_id: str, token: str, ttl_ms: int, *, again: bool = False
    ) -> StepView | None:
        """Lock the turn for a step (or keep the lock, `again`) and read it, in one round
        trip; None if another step holds it (or, `again`, this step lost it)."""
        script = self._reread if again else self._begin
        raw = script(
            keys=[
                k.step_lock_key(turn_id),
                k.dirty_key(turn_id),
                k.turn_key(turn_id),
                k.history_key(turn_id),
                k.results_key(turn_id),
                k.calls_key(turn_id),
                k.plan_key(turn_id),
            ],
            args=[token, ttl_ms],
        )
        if not raw:
            return None
        return step_view(*raw)

    def commit(
        self,
        turn_id: str,
        token: str,
        fields: dict[str, Any],
        append: list[dict[str, Any]] | None = None,
        *,
        plans: dict[str, str] | None = None,
        events: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> bool:
        """Write state fields, append history messages, store call plans (call id -> plan
        JSON) and publish events, in one write, if this step still holds the lock."""
        messages = [json.dumps(m) for m in append or []]
        plan_pairs = [x for c, p in (plans or {}).items() for x in (c, p)]
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
                k.step_lock_key(turn_id),
                k.turn_key(turn_id),
                k.history_key(turn_id),
                k.plan_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
            ],
            args=args,
            again=False,
        )
        return bool(ok)

    def release_step(
        self,
        turn_id: str,
        token: str,
        next_wake_at: float | None,
        ttl_ms: int,
        dispatched: dict[str, dict[str, Any]] | None = None,
        *,
        fields: dict[str, Any] | None = None,
        events: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> int:
        """Let go of the step's lock, writing state `fields` and publishing `events` (what
        the step staged) and recording the calls it sent (`dispatched`, see
        `record_dispatch`) while it still holds it: 1 released; 0 woken meanwhile, lock
        kept: step again; -1 the lock was lost (nothing written)."""
        fields = fields or {}
        bodies = [event_body(turn_id, t, f) for t, f in events or []]
        args: list[Any] = [token, turn_id, "" if next_wake_at is None else repr(next_wake_at)]
        args += [ttl_ms, len(fields), len(bodies), self.bus.log_arg() if bodies else ""]
        for f, v in fields.items():
            args += [f, json.dumps(v)]
        args += [*bodies, *dispatch_args(dispatched or {})]
        keys = [k.step_lock_key(turn_id), k.dirty_key(turn_id), k.turn_wakeups_key(turn_id)]
        keys += [k.calls_key(turn_id), k.outstanding_key(turn_id), k.results_key(turn_id)]
        keys += [k.turn_key(turn_id), k.log_key(turn_id), k.events_channel(turn_id)]
        if not (dispatched or fields or bodies):
            return int(self._release(keys=keys, args=args))
        # Not sent again: a second run finds the lock gone (and would publish twice).
        # Records a failover loses are of calls a later step sends again, which their
        # start claims run once.
        return int(self._durable(self._release, keys=keys, args=args, again=False))

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
                keys=[k.dirty_key(turn_id), k.turn_wakeups_key(turn_id), k.turn_key(turn_id)],
                args=[turn_id, time.time() + WAKE_BACKSTOP_S, self.ttl_s],
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
                keys=[k.turn_wakeups_key(turn_id), k.dirty_key(turn_id)],
                args=[turn_id, now, now + retry_s, self.ttl_s],
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
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(k.results_key(turn_id), call_ids)
            pipe.hmget(k.calls_key(turn_id), call_ids)
            if plans:
                pipe.hmget(k.plan_key(turn_id), call_ids)
            results, calls, *raw_plans = pipe.execute()
        return (
            raw_plans[0] if plans else [],
            {
                c: ToolResult.model_validate_json(r)
                for c, r in zip(call_ids, results, strict=True)
                if r
            },
            {c: json.loads(d) for c, d in zip(call_ids, calls, strict=True) if d},
        )
