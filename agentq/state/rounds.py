"""Model rounds: who streams each, its lease, and its result (fields of the turn's state)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from redis.commands.core import Script

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD, ended_lua, event_body, publish_lua
from agentq.state.base import WAKE_BACKSTOP_S, StoreBase, now_ms, text
from agentq.state.lua import turn_open_lua, wake_or_step_lua

# A round's end: the events of it not published yet (its last deltas, llm_finished), its
# result (fields of the turn's state, in the HSET of its seq), and the turn woken (or
# stepped here), in one write.
FINISH_LLM_LUA = (
    # A round's end always wakes its turn: a writer that steps it reads the state whole.
    turn_open_lua("KEYS[2]", "-2", whole="ARGV[4] ~= ''")
    + """
for i = 9, #ARGV do
"""
    + publish_lua("KEYS[3]", "KEYS[4]", "ARGV[i]", "ARGV[6]", "watched")
    + """
end
"""
    + wake_or_step_lua(
        ("KEYS[1]", "ARGV[1]", "ARGV[2]"),
        "KEYS[2]",
        "ARGV[4]",
        "ARGV[5]",
        "ARGV[7]",
        fields=f"'{SEQ_FIELD}', seq, '{k.LLM_RESULT_FIELD}', ARGV[3], "
        f"'{k.LLM_RESULT_ROUND_FIELD}', ARGV[8], '{k.LLM_ALIVE_FIELD}', 'null'",
        whole=True,
    )
    + "return 1"
)

# A stream worker takes a model round: unless it has a result, its turn is over or another
# delivery holds its lease (LLM_ALIVE_FIELD), claim it, publish llm_started, and read what
# the round needs, in one step (each round trip is a handoff to a thread on a stream
# worker that holds thousands of rounds). It answers whether anyone follows the turn,
# which decides how often its deltas go out. ARGV[1] is the lease the worker takes
# (`constants.llm_alive_value`), ARGV[2] its clock (ms).
BEGIN_LLM_LUA = (
    f"""
local st = redis.call('HGETALL', KEYS[1])
local at = {{}}
for i = 1, #st, 2 do at[st[i]] = i + 1 end
local function get(f) return at[f] and st[at[f]] or false end
local status, watched, cancelled = get('status'), get('{WATCHERS_FIELD}'), get('{k.CANCEL_FIELD}')
local seq = tonumber(get('{SEQ_FIELD}')) or 0
if (tonumber(get('{k.LLM_RESULT_ROUND_FIELD}')) or -1) >= tonumber(ARGV[5]) then return {{1}} end
if not status or {ended_lua("status")} then return {{2}} end
local alive = get('{k.LLM_ALIVE_FIELD}')
if alive then
  local r, u = string.match(alive, '^"(%-?%d+):(%d+):')
  if tonumber(r) == tonumber(ARGV[5]) and tonumber(u) > tonumber(ARGV[2]) then return {{3}} end
end
"""
    + publish_lua("KEYS[2]", "KEYS[3]", "ARGV[3]", "ARGV[4]", "watched")
    + f"""
redis.call('HSET', KEYS[1], '{SEQ_FIELD}', seq, '{k.LLM_TAKEN_FIELD}', ARGV[5],
  '{k.LLM_ALIVE_FIELD}', ARGV[1])
local followed = watched and tonumber(watched) > 0 and 1 or 0
local hist = {{}}
for i = 1, #st, 2 do
  if string.sub(st[i], 1, 2) == '{k.MESSAGE}' then
    hist[tonumber(string.sub(st[i], 3)) + 1] = st[i + 1]
  end
end
return {{0, cancelled and 1 or 0, hist, followed}}
"""
)


@dataclass(frozen=True)
class LlmRoundStart:
    """What a stream worker found when it took a round: a result already stored, a turn
    that is over, another delivery streaming it, or the round claimed with its history."""

    done: bool = False
    gone: bool = False
    elsewhere: bool = False
    claimed: bool = False
    cancelled: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)
    followed: bool = False
    """Someone followed the turn live when the round was claimed."""


class RoundRecords(StoreBase):
    """A round's claim by a stream worker, its liveness lease and its stored result."""

    LUA: ClassVar[dict[str, str]] = {
        "_finish_llm": FINISH_LLM_LUA,
        "_begin_llm": BEGIN_LLM_LUA,
    }
    _finish_llm: Script
    _begin_llm: Script

    def begin_llm_round(
        self, turn_id: str, round_no: int, worker: str, lease_ms: int, started: dict[str, Any]
    ) -> LlmRoundStart:
        """Claim a model round for this stream worker, publish its llm_started (`started`:
        the event's fields) and read its history, in one step."""
        now = now_ms()
        res = self._begin_llm(
            keys=[k.turn_key(turn_id), k.log_key(turn_id), k.events_channel(turn_id)],
            args=[
                k.llm_alive_value(round_no, now + lease_ms, worker),
                now,
                event_body(turn_id, "llm_started", started),
                self.bus.log_arg(),
                round_no,
            ],
        )
        outcome = int(res[0])
        if outcome == 1:
            return LlmRoundStart(done=True)
        if outcome == 2:
            return LlmRoundStart(gone=True)
        if outcome == 3:
            return LlmRoundStart(elsewhere=True)
        self.bus.counted([("llm_started", started)])
        return LlmRoundStart(
            claimed=True,
            cancelled=bool(res[1]),
            history=[json.loads(m) for m in res[2]],
            followed=bool(res[3]),
        )

    def finish_llm_round(
        self,
        turn_id: str,
        round_no: int,
        result_json: str,
        events: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> None:
        """Publish the round's last `events`, store its result (LlmRoundResult JSON) and
        wake its turn, in one write."""
        token, lock_ms = self._inline_lock()
        ok = self._finish_llm(
            keys=[
                k.turn_wakeups_key(turn_id),
                k.turn_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
            ],
            args=[
                turn_id,
                time.time() + WAKE_BACKSTOP_S,
                result_json,
                token,
                lock_ms,
                self.bus.log_arg() if events else "",
                now_ms(),
                round_no,
                *[event_body(turn_id, t, f) for t, f in events or []],
            ],
        )
        if ok == 1 or isinstance(ok, list):
            self.bus.counted(events or [])
        woke = self._woke(
            turn_id, ok, token, lock_ms, wake=ok == 1, llm_result=(round_no, result_json)
        )
        if woke == -2:
            self.end_lost_turn(turn_id)

    def llm_result(self, turn_id: str, round_no: int) -> str | None:
        """The round's result (LlmRoundResult JSON) if it is the last one stored."""
        at, raw = self.redis.hmget(
            k.turn_key(turn_id), [k.LLM_RESULT_ROUND_FIELD, k.LLM_RESULT_FIELD]
        )
        if at is None or raw is None or int(at) != round_no:
            return None
        return text(raw) if text(raw) != "null" else None

    def llm_rounds_alive(self, rounds: dict[tuple[str, int], str], lease_ms: int) -> None:
        """Renew many rounds' leases in one round trip: (turn id, round) -> worker.

        A plain HSET: a renewal that lands after the round's result (which clears the
        lease) leaves a lease of a round that has its result, which nothing reads, and the
        turn's hash outlives every round of it (its retention starts when it ends)."""
        if not rounds:
            return
        until_ms = now_ms() + lease_ms
        pipe = self.redis.pipeline(transaction=False)
        for (turn_id, round_no), worker in rounds.items():
            value = k.llm_alive_value(round_no, until_ms, worker)
            pipe.hset(k.turn_key(turn_id), k.LLM_ALIVE_FIELD, value)
        pipe.execute()
