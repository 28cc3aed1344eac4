"""The Lua scripts behind `agentq.state.conversations` (keys: docs/conversations.md): every
decision about a conversation is one script, so turns racing for it never both get it."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.bus import ended_lua
from agentq.events.lua_args import bind_lua


class Admit(IntEnum):
    """ADMIT's answer."""

    NOT_FOUND = 0
    TOO_LARGE = 1
    RUN = 2
    BUSY = 3
    QUEUED = 4
    INJECTED = 5
    INTERRUPTED = 6


class Release(IntEnum):
    """RELEASE's answer: what became of the turn's exchange."""

    LEFT = 0
    """The turn did not hold the conversation: it left the queue, or the conversation is gone."""
    COMMITTED = 1
    DROPPED = 2
    """Rolled back: its exchange is not kept."""
    CONFLICT = 3
    """Appended, but the history had changed since the turn read it (never expected)."""


class ConversationKeys(NamedTuple):
    owner_key: str
    meta_key: str
    history_key: str
    queue_key: str
    inject_key: str

    @classmethod
    def of(cls, conversation_id: str) -> ConversationKeys:
        parts: tuple[k.ConversationPart, ...] = ("owner", "meta", "history", "queue", "inject")
        return cls._make(k.conversation_key(conversation_id, part) for part in parts)


_SCRIPT_KEYS = (*ConversationKeys._fields, "index_key")
"""The listing's index is on another slot of a Cluster: there the writes note it apart."""
_KEEP = "for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ttl_s) end\n"
_INDEX = "if index_key then redis.call('ZADD', index_key, now, conversation_id) end\n"


class AdmitArgs(NamedTuple):
    turn_id: str
    claim: str
    """The binding a conversation created now gets."""
    may: str
    """A binding the caller holds ('' for none)."""
    may_too: str
    any_owner: int
    """1: an admin or operator, who may continue any conversation."""
    mode: str
    """A `MultitaskMode`."""
    ttl_s: int
    now: float
    new_bytes: int
    max_bytes: int
    conversation_id: str


# Returns {NOT_FOUND}, {TOO_LARGE, size}, or {Admit, created, running, position, behind}.
ADMIT_LUA = (
    bind_lua(_SCRIPT_KEYS, AdmitArgs)
    + f"""local bound = redis.call('GET', owner_key)
if bound and any_owner ~= '1' and bound ~= may and bound ~= may_too then
  return {{{Admit.NOT_FOUND}}}
end
-- Whatever outlived an expired binding is not this caller's to read.
if not bound then redis.call('DEL', meta_key, history_key, queue_key, inject_key) end
local size = (tonumber(redis.call('HGET', meta_key, 'bytes')) or 0) + tonumber(new_bytes)
if size > tonumber(max_bytes) then return {{{Admit.TOO_LARGE}, size}} end
local created = bound and 0 or 1
if not bound then redis.call('SET', owner_key, claim, 'EX', ttl_s) end
{_KEEP}{_INDEX}local running = redis.call('HGET', meta_key, 'running')
if not running or running == '' then
  redis.call('HSET', meta_key, 'running', turn_id, 'updated_at', now)
  redis.call('EXPIRE', meta_key, ttl_s)
  return {{{Admit.RUN}, created, '', 0, ''}}
end
if mode == 'reject' then return {{{Admit.BUSY}, created, running, 0, ''}} end
local answer = {Admit.QUEUED}
if mode == 'interrupt' or mode == 'rollback' then
  redis.call('LPUSH', queue_key, turn_id)
  if mode == 'rollback' then redis.call('HSET', meta_key, 'rollback', running) end
  answer = {Admit.INTERRUPTED}
else
  redis.call('RPUSH', queue_key, turn_id)
  if mode == 'inject' then
    redis.call('SADD', inject_key, turn_id)
    answer = {Admit.INJECTED}
  end
end
redis.call('HSET', meta_key, 'updated_at', now)
{_KEEP}local queue = redis.call('LRANGE', queue_key, 0, -1)
local position, behind = 1, running
for i, id in ipairs(queue) do
  if id == turn_id then position = i; if i > 1 then behind = queue[i - 1] end; break end
end
return {{answer, created, running, position, behind}}
"""
)


class ReleaseArgs(NamedTuple):
    turn_id: str
    base_len: int
    """The history's length when the turn read it, as an append expects it (-1: not read)."""
    ttl_s: int
    now: float
    conversation_id: str
    rolled_back: bool
    """Aborted for a rollback: its exchange is dropped (one that ended first is kept)."""
    gone: list[str]
    """Queued turns whose message this turn took in (inject): they leave the queue."""
    messages: list[str]
    """The turn's exchange, as JSON."""

    def argv(self) -> list[Any]:
        """RELEASE's ARGV: the first six fields, `n_gone`, those turns, then the messages."""
        return [*self[:5], int(self.rolled_back), len(self.gone), *self.gone, *self.messages]


# Returns {Release, next turn id or ''}.
RELEASE_LUA = (
    bind_lua(_SCRIPT_KEYS, (*ReleaseArgs._fields[:6], "n_gone"), rest="tail")
    + f"""local first_message = tail_at + tonumber(n_gone)
for i = tail_at, first_message - 1 do
  redis.call('LREM', queue_key, 0, ARGV[i])
  redis.call('SREM', inject_key, ARGV[i])
end
if redis.call('HGET', meta_key, 'running') ~= turn_id then
  redis.call('LREM', queue_key, 0, turn_id)
  redis.call('SREM', inject_key, turn_id)
  return {{{Release.LEFT}, ''}}
end
local outcome = {Release.COMMITTED}
local dropped = false
if redis.call('HGET', meta_key, 'rollback') == turn_id then
  redis.call('HDEL', meta_key, 'rollback')
  dropped = rolled_back == '1'
end
local length = redis.call('LLEN', history_key)
local base = length
local replacing = redis.call('HGET', meta_key, 'replacing') == turn_id
if replacing then
  -- A retry in place: its exchange takes the slot of the exchange it replaces.
  redis.call('HDEL', meta_key, 'replacing')
  base = tonumber(redis.call('HGET', meta_key, 'last_base'))
end
if dropped then
  outcome = {Release.DROPPED}
elseif #ARGV >= first_message then
  local expected = tonumber(base_len)
  if replacing then expected = tonumber(redis.call('HGET', meta_key, 'last_end')) end
  if expected >= 0 and length ~= expected then
    -- Appended all the same: an exchange is never lost, and the count shows the fault.
    redis.call('HINCRBY', meta_key, 'conflicts', 1)
    outcome = {Release.CONFLICT}
    base = length
  elseif replacing then
    local cut = 0
    for _, m in ipairs(redis.call('LRANGE', history_key, base, -1)) do cut = cut + #m end
    if base == 0 then
      redis.call('DEL', history_key)
    else
      redis.call('LTRIM', history_key, 0, base - 1)
    end
    redis.call('HINCRBY', meta_key, 'bytes', -cut)
  end
  local size = 0
  for i = first_message, #ARGV do
    redis.call('RPUSH', history_key, ARGV[i])
    size = size + #ARGV[i]
  end
  redis.call('HINCRBY', meta_key, 'bytes', size)
end
local last_end = redis.call('LLEN', history_key)
redis.call('HSET', meta_key, 'last_turn', turn_id, 'last_base', base, 'last_end', last_end)
local next_turn = redis.call('LPOP', queue_key)
if next_turn then
  redis.call('SREM', inject_key, next_turn)
  redis.call('HSET', meta_key, 'running', next_turn, 'updated_at', now)
else
  redis.call('HDEL', meta_key, 'running')
  redis.call('HSET', meta_key, 'updated_at', now)
  next_turn = ''
end
{_KEEP}{_INDEX}return {{outcome, next_turn}}
"""
)


class Take(IntEnum):
    """A waiting turn's look at its conversation (`Conversations.take`)."""

    HOLDS = 1
    """It holds the conversation: its history follows."""
    WAITS = 2
    GONE = 3
    """Neither: the conversation was deleted, or the turn was never admitted."""


class InPlace(IntEnum):
    """IN_PLACE's answer for a retry of a conversation's turn."""

    RUN = 1
    """It holds the conversation, to replace its source's exchange."""
    MOVED_ON = 2
    """The source is not the conversation's last turn, or another turn holds or waits."""
    GONE = 3
    """The conversation was deleted (or expired)."""


class InPlaceArgs(NamedTuple):
    turn_id: str
    source_id: str
    """The turn whose exchange the retry replaces."""
    ttl_s: int
    now: float
    conversation_id: str


# Returns {InPlace, running turn or ''}. The retry was authorized on its source: no binding
# check; no cap either, as it replaces an exchange of the conversation's own.
IN_PLACE_LUA = (
    bind_lua(_SCRIPT_KEYS, InPlaceArgs)
    + f"""if redis.call('EXISTS', owner_key) == 0 then return {{{InPlace.GONE}, ''}} end
local running = redis.call('HGET', meta_key, 'running') or ''
if running ~= '' then return {{{InPlace.MOVED_ON}, running}} end
local last_end = tonumber(redis.call('HGET', meta_key, 'last_end') or -1)
if redis.call('LLEN', queue_key) > 0 or redis.call('HGET', meta_key, 'last_turn') ~= source_id
    or redis.call('LLEN', history_key) ~= last_end then
  return {{{InPlace.MOVED_ON}, ''}}
end
redis.call('HSET', meta_key, 'running', turn_id, 'replacing', turn_id, 'updated_at', now)
{_KEEP}{_INDEX}return {{{InPlace.RUN}, ''}}
"""
)

# Returns {meta, queue, inject, history (with_history)}: a conversation as one moment's.
READ_LUA = (
    bind_lua(ConversationKeys, ("with_history",))
    + """local history = {}
if with_history == '1' then history = redis.call('LRANGE', history_key, 0, -1) end
return {redis.call('HGETALL', meta_key), redis.call('LRANGE', queue_key, 0, -1),
  redis.call('SMEMBERS', inject_key), history}
"""
)

# Removes the conversation; returns its running and queued turns.
DELETE_LUA = (
    bind_lua(ConversationKeys)
    + """local out = redis.call('LRANGE', queue_key, 0, -1)
local running = redis.call('HGET', meta_key, 'running')
if running and running ~= '' then table.insert(out, 1, running) end
redis.call('DEL', owner_key, meta_key, history_key, queue_key, inject_key)
return out
"""
)

# Counts a message sent to join a running turn, which its next step sees with its state.
NOTE_INJECTED_LUA = (
    bind_lua(("turn_key",))
    + f"""local status = redis.call('HGET', turn_key, 'status')
if not status or {ended_lua("status")} then return 0 end
redis.call('HINCRBY', turn_key, 'inject_seq', 1)
return 1
"""
)
