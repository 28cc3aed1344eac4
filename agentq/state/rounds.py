"""Model rounds: who streams each, its lease, and its result (fields of the turn's state)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.state.base import WAKE_BACKSTOP_S, StoreBase, TurnKeys, now_ms
from agentq.state.held import held_writes
from agentq.state.lua import turn_open_lua, view_lua, wake_or_step_lua

ROUND_HOLD_S = 60.0
"""How long a model round's result waits for Redis to answer again."""


class RoundFinished(IntEnum):
    """What `finish_llm_round` did (FINISH_LLM_LUA answers it)."""

    TURN_GONE = -2
    """The turn is over, or Redis lost it: nothing written."""
    DONE = 0
    """The round has its result already (this write sent again, or a later failure report)."""
    WOKEN = 1
    STEPPED = 3
    """The result stored and the turn's step taken here (the answer carries its view)."""


class RoundBegun(IntEnum):
    """What `begin_llm_round` found (BEGIN_LLM_LUA answers it first)."""

    CLAIMED = 0
    """Claimed: the answer carries the cancel flag, the history and whether it is followed."""
    DONE = 1
    """The round has its result already."""
    GONE = 2
    """The turn is over, or Redis lost it."""
    ELSEWHERE = 3
    """Another delivery holds the round's lease."""


class FinishLlmArgs(NamedTuple):
    turn_id: str
    wake_at: float
    result: str
    """The round's LlmRoundResult JSON."""
    token: str
    lock_ms: int
    log_opts: str
    now_ms: int
    round_no: int


# FINISH_LLM_LUA: a round's unpublished events (its last deltas, llm_finished), its result
# and the turn woken (or stepped here), in one write.
FINISH_LLM_LUA = (
    bind_lua(TurnKeys, FinishLlmArgs, rest="events")
    + turn_open_lua(
        f"(tonumber(more[1]) or -1) >= tonumber(round_no) and {RoundFinished.DONE:d}"
        f" or {RoundFinished.TURN_GONE:d}",
        extra=(f"'{k.LLM_RESULT_ROUND_FIELD}'",),
    )
    + f"""if (tonumber(more[1]) or -1) >= tonumber(round_no) then return {RoundFinished.DONE:d} end
for i = events_at, #ARGV do
{publish_lua("log_key", "channel", "ARGV[i]", "log_opts", "watched")}
end
"""
    + wake_or_step_lua(
        f"'{SEQ_FIELD}', seq, '{k.LLM_RESULT_FIELD}', result, "
        f"'{k.LLM_RESULT_ROUND_FIELD}', round_no, '{k.LLM_ALIVE_FIELD}', 'null'",
        RoundFinished.STEPPED,
    )
    + f"return {RoundFinished.WOKEN:d}"
)


class BeginLlmArgs(NamedTuple):
    lease: str
    """The lease the worker takes (`constants.llm_alive_value`)."""
    now_ms: int
    event: str
    log_opts: str
    round_no: int


# BEGIN_LLM_LUA: a stream worker claims a round (unless it is over, answered or leased
# elsewhere), publishes llm_started and reads the history in one step: each round trip is a
# thread handoff on a worker holding thousands of rounds. Followers set the delta pace.
BEGIN_LLM_LUA = (
    bind_lua(TurnKeys, BeginLlmArgs)
    + turn_open_lua(
        f"{{{RoundBegun.GONE:d}}}",
        extra=(f"'{k.LLM_RESULT_ROUND_FIELD}'", f"'{k.LLM_ALIVE_FIELD}'"),
    )
    + f"""
local round = tonumber(round_no)
if (tonumber(more[1]) or -1) >= round then return {{{RoundBegun.DONE:d}}} end
if more[2] then
  local r, u = string.match(more[2], '^"(%-?%d+):(%d+):')
  if tonumber(r) == round and tonumber(u) > tonumber(now_ms) then
    return {{{RoundBegun.ELSEWHERE:d}}}
  end
end
{publish_lua("log_key", "channel", "event", "log_opts", "watched")}
redis.call('HSET', turn_key, '{SEQ_FIELD}', seq, '{k.LLM_TAKEN_FIELD}', round_no,
  '{k.LLM_ALIVE_FIELD}', lease)
local followed = watched and tonumber(watched) > 0 and 1 or 0
local st = redis.call('HGETALL', turn_key)
local view = {view_lua("st")}
return {{{RoundBegun.CLAIMED:d}, cancelled and 1 or 0, view[2], followed}}
"""
)


@dataclass(frozen=True)
class LlmRoundStart:
    """What a stream worker found when it took a round, and the claimed round's history."""

    outcome: RoundBegun
    cancelled: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    followed: bool = False
    """Someone followed the turn live when the round was claimed."""


class RoundRecords(StoreBase):
    """A round's claim by a stream worker, its liveness lease and its stored result."""

    _finish_llm = LuaScript(FINISH_LLM_LUA)
    _begin_llm = LuaScript(BEGIN_LLM_LUA)

    def begin_llm_round(
        self, turn_id: str, round_no: int, worker: str, lease_ms: int, started: dict[str, Any]
    ) -> LlmRoundStart:
        """Claim a model round, publish its llm_started (`started`) and read its history."""
        now = now_ms()
        args = BeginLlmArgs(
            k.llm_alive_value(round_no, now + lease_ms, worker),
            now,
            event_body(turn_id, "llm_started", started),
            self.bus.log_arg(),
            round_no,
        )
        res = self._begin_llm(keys=TurnKeys.of(turn_id), args=list(args))
        outcome = RoundBegun(int(res[0]))
        if outcome is not RoundBegun.CLAIMED:
            return LlmRoundStart(outcome)
        self.bus.counted([("llm_started", started)])
        return LlmRoundStart(outcome, bool(res[1]), [json.loads(m) for m in res[2]], bool(res[3]))

    def finish_llm_round(
        self,
        turn_id: str,
        round_no: int,
        result_json: str,
        events: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> None:
        """Publish the round's last `events`, store its result and wake its turn, in one write."""
        token, lock_ms = self._inline_lock()
        args = FinishLlmArgs(
            turn_id,
            time.time() + WAKE_BACKSTOP_S,
            result_json,
            token,
            lock_ms,
            self.bus.log_arg() if events else "",
            now_ms(),
            round_no,
        )
        bodies = [event_body(turn_id, t, f) for t, f in events or []]
        # Held while Redis is away (past redis-py's ~17 s of retries): a model's answer is not
        # replaced by "the stream worker failed" (a 25 s outage ended 7 turns of 30 so).
        ok = held_writes.hold(
            lambda: self._finish_llm(keys=TurnKeys.of(turn_id), args=[*args, *bodies]),
            time.time() + ROUND_HOLD_S,
            f"the result of round {round_no} of turn {turn_id}",
        )
        got = self._woke(turn_id, ok, token, lock_ms, wake=ok == RoundFinished.WOKEN)
        if got in (RoundFinished.WOKEN, RoundFinished.STEPPED):
            self.bus.counted(events or [])

    def llm_rounds_alive(self, rounds: dict[tuple[str, int], str], lease_ms: int) -> None:
        """Renew many rounds' leases in one round trip: (turn id, round) -> worker. A plain
        HSET: a renewal that lands after the round's result leaves a lease nothing reads."""
        until_ms = now_ms() + lease_ms
        pipe = self.redis.pipeline(transaction=False)
        for (turn_id, round_no), worker in rounds.items():
            value = k.llm_alive_value(round_no, until_ms, worker)
            pipe.hset(k.turn_key(turn_id), k.LLM_ALIVE_FIELD, value)
        pipe.execute()
