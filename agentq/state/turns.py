"""The turn itself: its state, its history, its children, and its end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, ended_lua, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import ToolResult, TurnStatus
from agentq.state.base import (
    START_BACKSTOP_S,
    WAKE_BACKSTOP_S,
    Settled,
    StoreBase,
    TurnKeys,
    call_fields,
    finished,
    history_of,
    state_of,
    statuses,
    text,
)
from agentq.state.lua import (
    LOCK_FREE_VALUE,
    lock_mine_lua,
    settle_lua,
    turn_open_lua,
    wake_lua,
    write_lua,
)
from agentq.state.turn_state import TurnState


class Closed(IntEnum):
    """What `close` did (CLOSE_LUA answers it)."""

    LOST = -1
    """The step's token no longer holds the lock: nothing written."""
    ENDED_ALREADY = 0
    """The turn had ended (or Redis lost it): nothing written."""
    ENDED = 1
    PARENT_WOKEN = 2
    """Ended here, its parent's call settled, and the parent woken (its batch complete)."""
    PARENT_WAITS = 3
    """Ended here and its parent's call settled; other calls of that batch are still out."""


_CLOSE_KEYS = (*TurnKeys._fields, "children_key", "parent_key", "parent_log_key", "parent_channel")
"""CLOSE's KEYS: the turn's, its children's set, and its parent's (its own without a parent)."""


class CloseArgs(NamedTuple):
    turn_id: str
    ttl_s: int
    event: str
    log_opts: str
    parent_id: str
    """"": the turn has no parent call to settle."""
    parent_call_id: str
    parent_result: str
    parent_event: str
    wake_at: float
    token: str
    """The step's lock token ("": not fenced)."""
    n_messages: int
    hands_off: str
    """"1": work follows this write (a conversation's hand-off, a webhook's delivery): the
    wakeup stays."""


# CLOSE_LUA: a turn's status, terminal event and keys' TTL in one step: one ending wins and
# nothing is published after it. A child settles its parent's call in the same step (as
# SETTLE_LUA). A step's end is fenced by its lock and carries its uncommitted messages.
# KEYS after the named ones get the TTL; ARGV: the messages, then the fields.
CLOSE_LUA = (
    bind_lua(_CLOSE_KEYS, CloseArgs, rest="messages")
    + turn_open_lua(f"{Closed.ENDED_ALREADY:d}")
    + f"""if token ~= '' and not {lock_mine_lua("held")} then return {Closed.LOST:d} end
local fields_at = messages_at + tonumber(n_messages)
{publish_lua("log_key", "channel", "event", "log_opts", "watched")}
local w = {{unpack(ARGV, fields_at, #ARGV)}}
w[#w + 1] = '{SEQ_FIELD}'
w[#w + 1] = seq
{write_lua("turn_key", "w", "messages_at", "fields_at - 1")}
if hands_off == '1' then
  -- Work follows this write: the wakeup stays, due at the backstop, should the process die
  -- in between (that work takes it away).
  redis.call('ZADD', wakeups_key, wake_at, turn_id)
else
  redis.call('ZREM', wakeups_key, turn_id)
end
if kids then redis.call('DEL', children_key) end
for i = {len(_CLOSE_KEYS) + 1}, #KEYS do redis.call('EXPIRE', KEYS[i], ttl_s) end
if parent_id == '' then return {Closed.ENDED:d} end
-- SETTLE_LUA's settle on the parent's keys; the parent recorded the call: it is tracked.
local function settle_parent()
  local turn_key, log_key, channel, turn_id = parent_key, parent_log_key, parent_channel, parent_id
  local call_id, result, event = parent_call_id, parent_result, parent_event
  local tracked, wake, deadline_ms, token = '1', '1', '', ''
"""
    + settle_lua(Settled)
    + f"""end
local settled = settle_parent()
if settled == {Settled.READY:d} then return {Closed.PARENT_WOKEN:d} end
return settled == {Settled.WON:d} and {Closed.PARENT_WAITS:d} or {Closed.ENDED:d}
"""
)


class FlagCancelArgs(NamedTuple):
    reason: str
    ttl_s: int
    turn_id: str
    reason_json: str
    """The reason as JSON, for the turn's state."""
    wake_at: float
    """When a sweeper steps the turn should the abort's step message never be sent."""


# FLAG_CANCEL_LUA: the cancel flag, in the turn's state too, where scripts read it; an open
# turn is woken in the same write (an abort's sender may die before sending the step). A
# script: a Cluster pipeline takes no PUBLISH. Returns {woken (1: open), children...}.
FLAG_CANCEL_LUA = (
    bind_lua((*TurnKeys._fields, "cancel_key", "children_key"), FlagCancelArgs)
    + f"""
redis.call('SET', cancel_key, reason, 'NX', 'EX', ttl_s)
local status = redis.call('HGET', turn_key, 'status')
local woken = 0
if status then
  redis.call('HSETNX', turn_key, '{k.CANCEL_FIELD}', reason_json)
  if not ({ended_lua("status")}) then
{wake_lua()}    woken = 1
  end
end
redis.call('PUBLISH', '{k.CANCEL_CHANNEL}', turn_id)
local out = {{woken}}
for _, c in ipairs(redis.call('SMEMBERS', children_key)) do out[#out + 1] = c end
return out
"""
)


@dataclass(frozen=True)
class TurnSnapshot:
    """A turn as one read of its state hash found it."""

    turn_id: str
    state: TurnState
    history: list[dict[str, Any]]
    results: dict[str, str]
    """Its calls' settled results (ToolResult JSON), by call id."""
    started: frozenset[str]
    """Its calls a worker started (their start record)."""


class TurnRecords(StoreBase):
    """A turn's state hash, history and children; `close` ends it once."""

    _close = LuaScript(CLOSE_LUA)
    _flag_cancel = LuaScript(FLAG_CANCEL_LUA)

    def flag_cancel(self, turn_id: str, reason: str) -> tuple[bool, list[str]]:
        """Flag the turn cancelled (the first reason stays), wake it and tell the event loops
        holding its calls; whether it was open (the caller sends its step) and its children."""
        keys = [*TurnKeys.of(turn_id), *(k.turn_key(turn_id, p) for p in ("cancel", "children"))]
        wake_at = time.time() + WAKE_BACKSTOP_S
        args = FlagCancelArgs(reason, self.ttl_s, turn_id, json.dumps(reason), wake_at)
        woken, *children = self._flag_cancel(keys=keys, args=list(args))
        return bool(int(woken)), [text(c) for c in children]

    def create(
        self,
        turn_id: str,
        state: TurnState,
        history: list[dict[str, Any]],
        records: dict[str, str] | None = None,
        backstop_s: float = START_BACKSTOP_S,
    ) -> None:
        """Store a new turn, woken: a lost first step message is swept up after `backstop_s`.
        `records`: call records it starts with (a retry's settled calls)."""
        fields = {f: json.dumps(v) for f, v in state.items()}
        # Written whole, so sending it again (see _durable_write) is harmless.
        fields.update({f"{k.MESSAGE}{i}": json.dumps(m) for i, m in enumerate(history)})
        if history:
            fields[k.HISTORY_LEN_FIELD] = str(len(history))
        fields.update(records or {})
        created = float(state.get("created_at") or time.time())

        def build(pipe: Any) -> None:
            pipe.hset(k.turn_key(turn_id), mapping=fields)
            pipe.zadd(k.shard_key(k.TURNS_INDEX, turn_id), {turn_id: created})
            # No dirty mark: no step can hold a turn that did not exist.
            pipe.zadd(k.shard_key(k.WAKEUPS, turn_id), {turn_id: time.time() + backstop_s})
            parent = state.get("parent_turn_id")
            if parent:
                pipe.sadd(k.turn_key(parent, "children"), turn_id)
                pipe.hset(k.turn_key(parent), k.CHILDREN_FIELD, "1")

        # Not MULTI/EXEC: nothing steps the turn before its step is sent, after this
        # returns, and a reader meanwhile sees a turn just queued either way.
        self._durable_write(build)

    def state(self, turn_id: str) -> TurnState | None:
        """The turn's state fields (its records left out), None if Redis has none."""
        raw = self.redis.hgetall(k.turn_key(turn_id))
        return state_of(raw) if raw else None

    def snapshot(self, turn_id: str) -> TurnSnapshot | None:
        """The turn as one read of its state hash found it (None: Redis has no such turn)."""
        raw = self.redis.hgetall(k.turn_key(turn_id))
        if not raw:
            return None
        return TurnSnapshot(
            turn_id,
            state_of(raw),
            history_of(raw),
            {c: text(v) for c, v in call_fields(raw, k.SETTLED).items()},
            frozenset(call_fields(raw, k.STARTED)),
        )

    def update(self, turn_id: str, **fields: Any) -> None:
        self.redis.hset(k.turn_key(turn_id), mapping={f: json.dumps(v) for f, v in fields.items()})

    def status(self, turn_id: str) -> str | None:
        return statuses(self.redis, [turn_id])[0]

    def close(
        self,
        turn_id: str,
        status: TurnStatus,
        event: str,
        event_fields: dict[str, Any],
        *,
        settle_parent: tuple[str, ToolResult] | None = None,
        token: str = "",
        append: list[dict[str, Any]] | None = None,
        hands_off: bool = False,
        **fields: Any,
    ) -> Closed:
        """End the turn (status, terminal event, retention TTL) atomically, unless it had
        ended or `token` no longer holds the step lock (see `Closed` and CLOSE_LUA).
        `settle_parent`: (parent turn id, result) of the parent's call it settles."""
        messages = [json.dumps(m) for m in append or []]
        ended = {"status": status.value, "ended_at": time.time(), **fields}
        flat = [x for f, v in ended.items() for x in (f, json.dumps(v))]
        if token:
            flat += [k.STEP_FIELD, LOCK_FREE_VALUE]  # the end lets go of the step's lock
        parent, result = settle_parent or ("", None)
        pid = parent or turn_id  # placeholders the script leaves alone without a parent
        keys = [*TurnKeys.of(turn_id), k.turn_key(turn_id, "children"), *TurnKeys.of(pid)[:3]]
        keys += k.turn_keys(turn_id)
        args = CloseArgs(
            turn_id,
            self.ttl_s,
            event_body(turn_id, event, event_fields),
            self.bus.log_arg(),
            parent,
            "" if result is None else result.call_id,
            "" if result is None else result.model_dump_json(),
            "" if result is None else event_body(pid, "tool_finished", finished(result)),
            time.time() + WAKE_BACKSTOP_S,
            token,
            len(messages),
            "1" if hands_off else "0",
        )
        won = Closed(int(self._durable(self._close, keys, [*args, *messages, *flat])))
        if won >= Closed.ENDED:
            counted = [(event, event_fields)]
            if won is not Closed.ENDED and result is not None:
                counted.append(("tool_finished", finished(result)))
            self.bus.counted(counted)
        if won is Closed.PARENT_WOKEN:
            self.send_step(parent)
        return won

    def history(self, turn_id: str) -> list[dict[str, Any]]:
        """The turn's messages, in order ([] if Redis has no such turn)."""
        return history_of(self.redis.hgetall(k.turn_key(turn_id)))

    def children(self, turn_id: str) -> list[str]:
        return [text(c) for c in self.redis.smembers(k.turn_key(turn_id, "children"))]
