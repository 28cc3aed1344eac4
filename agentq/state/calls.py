"""Tool calls: their dispatch records, their starts, and exactly one result each."""

from __future__ import annotations

import json
import time
from enum import IntEnum
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import ToolResult
from agentq.state.base import (
    WAKE_BACKSTOP_S,
    Settled,
    StoreBase,
    TurnKeys,
    active_turns,
    dispatch_args,
    exist,
    finished,
    first_send,
    now_ms,
    records_of,
    text,
)
from agentq.state.lua import settle_lua, turn_open_lua


class Started(IntEnum):
    """What `mark_started` found (START_LUA answers it)."""

    TURN_GONE = -2
    """The turn is over, or Redis lost it: the call does not run."""
    CANCELLED = -1
    """The turn is cancelled: the call does not run (and is settled as such)."""
    SETTLED = 0
    """The call has its result already (a redelivery)."""
    STARTED = 1
    """Recorded: the call runs."""
    REDELIVERED = 2
    """This delivery started already (a restored unacked message): not run twice."""


class SettleArgs(NamedTuple):
    call_id: str
    result: str
    event: str
    log_opts: str
    now_ms: int
    wake_at: float
    turn_id: str
    wake: str
    """"1": wake the turn if the batch is complete ("0": the turn's own step settles)."""
    token: str
    lock_ms: int
    tracked: str
    """"1": the call was recorded as sent, so it counts in the batch in flight."""
    deadline_ms: str
    """A waitpoint's completion: its deadline, past which nothing is stored ("": none)."""


# SETTLE_LUA: store the result (first writer wins), publish and wake in one step (`settle_lua`).
SETTLE_LUA = bind_lua(TurnKeys, SettleArgs) + settle_lua(Settled)


class StartArgs(NamedTuple):
    call_id: str
    start: str
    """The start record (JSON), with its `claim`."""
    event: str
    log_opts: str
    delivery: str
    """The delivery's task id and retry count ("": not known)."""


# START_LUA: a start is recorded only if its call is not settled (a redelivery) and its turn
# not cancelled. The record names the delivery, so a restored unacked message does not run
# the call twice, and the claim (random per attempt), so redis-py sending START again after
# a reply lost to a Redis restart finds its own claim and runs the call.
START_LUA = (
    bind_lua(TurnKeys, StartArgs)
    + turn_open_lua(
        f"more[1] and {Started.SETTLED:d} or {Started.TURN_GONE:d}",
        extra=(f"'{k.SETTLED}' .. call_id", f"'{k.STARTED}' .. call_id"),
    )
    + f"""
if more[1] then return {Started.SETTLED:d} end
if cancelled then return {Started.CANCELLED:d} end
if more[2] and delivery ~= '' then
  local ok, rec = pcall(cjson.decode, more[2])
  if ok and rec['delivery'] == delivery then
    -- The same claim is this start sent again (its answer was lost as Redis went away):
    -- it is recorded and the call runs. Another claim is the broker's second copy.
    if rec['claim'] == nil or rec['claim'] ~= cjson.decode(start)['claim'] then
      return {Started.REDELIVERED:d}
    end
    return {Started.STARTED:d}
  end
end
{publish_lua("log_key", "channel", "event", "log_opts", "watched")}
redis.call('HSET', turn_key, '{k.STARTED}' .. call_id, start, '{SEQ_FIELD}', seq)
return {Started.STARTED:d}
"""
)

# RECORD_DISPATCH_LUA: dispatch records written apart from a step's release (a sub-agent's
# child turn): new ones join the batch in flight. Never into a turn Redis lost (half a turn).
RECORD_DISPATCH_LUA = (
    bind_lua(("turn_key",), (), rest="records")
    + f"""
if redis.call('EXISTS', turn_key) == 0 then return 0 end
local counted = redis.call('HSET', turn_key, unpack(ARGV, records_at))
if counted > 0 then
  redis.call('HINCRBY', turn_key, '{k.UNSETTLED_FIELD}', counted)
end
return 1
"""
)


class CallRecords(StoreBase):
    """Dispatch records, start records and settled results, by call id."""

    _settle = LuaScript(SETTLE_LUA)
    _start = LuaScript(START_LUA)
    _record_dispatch = LuaScript(RECORD_DISPATCH_LUA)

    def record_dispatch(self, turn_id: str, records: dict[str, dict[str, Any]]) -> None:
        """Record calls as sent; unsettled ones join the batch in flight whose last settle wakes."""
        if not records:
            return
        self._durable(self._record_dispatch, [k.turn_key(turn_id)], dispatch_args(records))

    def unrecord(self, turn_id: str, records: dict[str, dict[str, Any]]) -> None:
        """Take back the records of calls the step holding the turn could not send (the broker
        went away): a new one leaves the batch in flight, one sent again gets its count back."""
        if not records:
            return
        key, pipe = k.turn_key(turn_id), self.redis.pipeline(transaction=False)
        new = [k.DISPATCHED + c for c, r in records.items() if first_send(r)]
        if new:
            pipe.hdel(key, *new)
            pipe.hincrby(key, k.UNSETTLED_FIELD, -len(new))
        for c, r in records.items():
            if not first_send(r):
                pipe.hset(key, k.DISPATCHED + c, json.dumps({**r, "sends": int(r["sends"]) - 1}))
        pipe.execute()

    def call_progress(self, turn_id: str) -> list[dict[str, Any]]:
        """The starts, dispatch records and open waitpoints of the turn's calls, from one read."""
        return self._calls(turn_id, k.STARTED, k.DISPATCHED, k.WAITING)

    def running_tasks(self, turn_id: str) -> dict[str, dict[str, Any]]:
        """Task id -> start record (`worker`, `pid`) of each started call without a result."""
        kinds = (k.STARTED, k.DISPATCHED, k.SETTLED, k.WAITING)
        starts, records, settled, waiting = self._calls(turn_id, *kinds)
        # A waiting call's task has ended: nothing of it runs to stop.
        done = settled.keys() | waiting.keys()
        # Agent calls have no task: their child turns are aborted instead.
        return {
            d["task_id"]: starts[cid]
            for cid, d in records.items()
            if cid not in done and cid in starts and d.get("task_id")
        }

    def mark_started(
        self, turn_id: str, call_id: str, start: dict[str, Any], event: dict[str, Any]
    ) -> Started:
        """Record a task's start, unless the call must not run (see `Started`)."""
        args = StartArgs(
            call_id,
            json.dumps(start),
            event_body(turn_id, "tool_started", event),
            self.bus.log_arg(),
            str(start.get("delivery") or ""),
        )
        answer = self._durable(self._start, TurnKeys.of(turn_id), list(args), claim=True)
        return Started(int(answer))

    def turns_running_on(self, worker: str, batch: int = 500) -> list[str]:
        """The open turns with a start record of `worker` watched by its `heartbeat`: read
        only when a worker stops beating, so no call pays a write to a per-worker index."""
        needle = json.dumps(worker)
        ids = active_turns(self.redis)
        found: list[str] = []
        for i in range(0, len(ids), batch):
            chunk = ids[i : i + batch]
            starts_of = records_of(self.redis, chunk, k.STARTED[0])
            for turn_id, raw in zip(chunk, starts_of, strict=True):
                starts = [json.loads(v) for v in raw.values() if needle in text(v)]
                if any(s.get("worker") == worker and s.get("heartbeat") for s in starts):
                    found.append(turn_id)
        return found

    def workers_alive(self, hostnames: list[str]) -> dict[str, bool]:
        """Which workers sent a heartbeat lately."""
        alive = exist(self.redis, [k.worker_alive_key(h) for h in hostnames])
        return dict(zip(hostnames, alive, strict=True))

    def redis_up_s(self) -> float | None:
        """How long Redis has been up (the least of a Cluster's nodes); None if not known:
        heartbeats that lapsed while Redis restarted say nothing about the workers."""
        try:
            info = self.redis.info("server")
        except Exception:
            return None
        found = [info] if "uptime_in_seconds" in info else list(info.values())
        ups = [float(i["uptime_in_seconds"]) for i in found if isinstance(i, dict) and i]
        return min(ups) if ups else None

    def settle(self, turn_id: str, result: ToolResult, **opts: bool) -> bool:
        """`settle_code`: True if this result was stored (WON or READY)."""
        return self.settle_code(turn_id, result, **opts) in (Settled.WON, Settled.READY)

    def settle_code(
        self,
        turn_id: str,
        result: ToolResult,
        *,
        wake: bool = True,
        tracked: bool = True,
        deadline_ms: int | None = None,
    ) -> Settled:
        """Store a call's result unless one is stored already (first writer wins). `wake=False`:
        the turn's own step; `tracked=False`: a call never sent; `deadline_ms`: a waitpoint's."""
        event = finished(result)
        token, lock_ms = self._inline_lock() if wake else ("", 0)
        args = SettleArgs(
            result.call_id,
            result.model_dump_json(),
            event_body(turn_id, "tool_finished", event),
            self.bus.log_arg(),
            now_ms(),
            time.time() + WAKE_BACKSTOP_S,
            turn_id,
            "1" if wake else "0",
            token,
            lock_ms,
            "1" if tracked else "0",
            "" if deadline_ms is None else str(deadline_ms),
        )
        answer = self._durable(self._settle, keys=TurnKeys.of(turn_id), args=list(args))
        got = Settled(
            self._woke(turn_id, answer, token, lock_ms, wake=wake and answer == Settled.READY)
        )
        if got in (Settled.WON, Settled.READY):
            self.bus.counted([("tool_finished", event)])
        return got

    def result(self, turn_id: str, call_id: str) -> ToolResult | None:
        raw = self.redis.hget(k.turn_key(turn_id), k.SETTLED + call_id)
        return None if raw is None else ToolResult.model_validate_json(raw)

    def results(self, turn_id: str) -> dict[str, ToolResult]:
        settled = self._calls(turn_id, k.SETTLED)[0]
        return {c: ToolResult.model_validate_json(v) for c, v in settled.items()}
