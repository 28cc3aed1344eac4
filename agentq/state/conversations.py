"""Conversations: one history that successive turns append to, one turn at a time.

A conversation is five keys under one hash tag (``{<conversation id>}``), so each script
below runs on one slot:

- ``owner``: who may continue it (sha256 of its owner's key name, or of a conversation
  token returned to the creator once); to anyone else it is unknown.
- ``history``: a list of its messages. Turns only ever append to it (RPUSH), each its own
  exchange, at its end; nothing replaces it.
- ``meta``: a hash: ``running`` (the one turn that holds the conversation), ``rollback``
  (a running turn whose exchange is to be dropped), ``bytes``, ``updated_at``,
  ``conflicts`` (appends that found the history changed under them: never expected).
- ``queue``: the turns waiting for it, in the order they run.
- ``inject``: the queued turns whose message may join the running turn instead.

A turn is admitted (`admit`) when its conversation is idle, else follows its request's
`Multitask`; at its end it commits its exchange and hands the conversation to the next
queued turn in one step (`release`). A conversation whose binding expired is gone.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, NamedTuple

import redis
from redis.cluster import RedisCluster

from agentq import constants as k
from agentq.errors import ConversationNotFound, PayloadTooLarge
from agentq.events.bus import ended_lua
from agentq.events.lua_args import TurnKey, argv_of, bind_lua


class Multitask(str, Enum):
    """What a message to a conversation whose turn still runs does."""

    ENQUEUE = "enqueue"
    REJECT = "reject"
    INTERRUPT = "interrupt"
    ROLLBACK = "rollback"
    INJECT = "inject"


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
    """The turn did not hold the conversation: it left the queue (aborted while queued, or
    its message joined the running turn), or the conversation is gone."""
    COMMITTED = 1
    DROPPED = 2
    """Rolled back: its exchange is not kept."""
    CONFLICT = 3
    """Appended, but the history had changed since the turn read it (never expected)."""


_MODE = {m: i for i, m in enumerate(Multitask)}


def binding(kind: str, value: str) -> str:
    return f"{kind}:{hashlib.sha256(value.encode()).hexdigest()}"


def held_bindings(owner: str | None, token: str | None) -> tuple[str, ...]:
    """The bindings a caller holds: its key's, and its conversation token's."""
    held = []
    if owner:
        held.append(binding("owner", owner))
    if token:
        held.append(binding("secret", token))
    return tuple(held)


class ConversationKeys(NamedTuple):
    owner_key: str
    meta_key: str
    history_key: str
    queue_key: str
    inject_key: str

    @classmethod
    def of(cls, conversation_id: str) -> ConversationKeys:
        return cls(
            k.conversation_owner_key(conversation_id),
            k.conversation_meta_key(conversation_id),
            k.conversation_key(conversation_id),
            k.conversation_queue_key(conversation_id),
            k.conversation_inject_key(conversation_id),
        )


_SCRIPT_KEYS = (*ConversationKeys._fields, "index_key")
"""A script's KEYS: the conversation's, and on one Redis (not a Cluster, where it is on
another slot) the listing's index, which the writes note the conversation's change in."""
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
    mode: int
    ttl_s: int
    now: float
    new_bytes: int
    max_bytes: int
    conversation_id: str


# KEYS: ConversationKeys; ARGV: AdmitArgs. Returns {Admit, ...}: NOT_FOUND; TOO_LARGE, size;
# RUN, created; BUSY, running; QUEUED|INJECTED|INTERRUPTED, created, running,
# position, behind.
ADMIT_LUA = (
    bind_lua(_SCRIPT_KEYS, AdmitArgs)
    + f"""mode = tonumber(mode)
local created = 0
if redis.call('SET', owner_key, claim, 'NX', 'EX', ttl_s) then
  -- Whatever outlived an expired binding is not this caller's to read.
  redis.call('DEL', meta_key, history_key, queue_key, inject_key)
  created = 1
else
  local bound = redis.call('GET', owner_key)
  if any_owner ~= '1' and bound ~= may and bound ~= may_too then
    return {{{Admit.NOT_FOUND}}}
  end
end
local size = (tonumber(redis.call('HGET', meta_key, 'bytes')) or 0) + tonumber(new_bytes)
if size > tonumber(max_bytes) then return {{{Admit.TOO_LARGE}, size}} end
"""
    + _KEEP
    + _INDEX
    + f"""local running = redis.call('HGET', meta_key, 'running')
if not running or running == '' then
  redis.call('HSET', meta_key, 'running', turn_id, 'updated_at', now)
  redis.call('EXPIRE', meta_key, ttl_s)
  return {{{Admit.RUN}, created}}
end
if mode == {_MODE[Multitask.REJECT]} then return {{{Admit.BUSY}, running}} end
local answer = {Admit.QUEUED}
if mode == {_MODE[Multitask.INTERRUPT]} or mode == {_MODE[Multitask.ROLLBACK]} then
  redis.call('LPUSH', queue_key, turn_id)
  if mode == {_MODE[Multitask.ROLLBACK]} then redis.call('HSET', meta_key, 'rollback', running) end
  answer = {Admit.INTERRUPTED}
else
  redis.call('RPUSH', queue_key, turn_id)
  if mode == {_MODE[Multitask.INJECT]} then
    redis.call('SADD', inject_key, turn_id)
    answer = {Admit.INJECTED}
  end
end
redis.call('HSET', meta_key, 'updated_at', now)
"""
    + _KEEP
    + """local queue = redis.call('LRANGE', queue_key, 0, -1)
local position, behind = 1, running
for i, id in ipairs(queue) do
  if id == turn_id then position = i; if i > 1 then behind = queue[i - 1] end; break end
end
return {answer, created, running, position, behind}
"""
)


class ReleaseArgs(NamedTuple):
    turn_id: str
    base_len: int
    """The history's length when the turn read it: an append finds it unchanged (-1: the
    turn ended before it read it, holding the conversation, so none is expected)."""
    ttl_s: int
    now: float
    conversation_id: str
    rolled_back: bool
    """The turn was aborted for a rollback: its exchange is dropped (a turn that ended on
    its own before the rollback could abort it is kept)."""
    gone: list[str]
    """Queued turns whose message this turn took in (inject): they leave the queue."""
    messages: list[str]
    """The turn's exchange, as JSON."""

    def argv(self) -> list[Any]:
        named = ReleaseNamed(
            self.turn_id,
            self.base_len,
            self.ttl_s,
            self.now,
            self.conversation_id,
            int(self.rolled_back),
            len(self.gone),
        )
        return argv_of(named, self.gone, self.messages)


class ReleaseNamed(NamedTuple):
    """RELEASE's named ARGV; the turns gone (`n_gone` of them), then the messages follow."""

    turn_id: str
    base_len: int
    ttl_s: int
    now: float
    conversation_id: str
    rolled_back: int
    n_gone: int


# KEYS: ConversationKeys; ARGV: ReleaseArgs.argv(). Returns {Release, next turn id or ''}.
RELEASE_LUA = (
    bind_lua(_SCRIPT_KEYS, ReleaseNamed, rest="tail")
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
if dropped then
  outcome = {Release.DROPPED}
elseif #ARGV >= first_message then
  if tonumber(base_len) >= 0 and redis.call('LLEN', history_key) ~= tonumber(base_len) then
    -- Appended all the same: an exchange is never lost, and the count shows the fault.
    redis.call('HINCRBY', meta_key, 'conflicts', 1)
    outcome = {Release.CONFLICT}
  end
  local size = 0
  for i = first_message, #ARGV do
    redis.call('RPUSH', history_key, ARGV[i])
    size = size + #ARGV[i]
  end
  redis.call('HINCRBY', meta_key, 'bytes', size)
end
local next_turn = redis.call('LPOP', queue_key)
if next_turn then
  redis.call('SREM', inject_key, next_turn)
  redis.call('HSET', meta_key, 'running', next_turn, 'updated_at', now)
else
  redis.call('HDEL', meta_key, 'running')
  redis.call('HSET', meta_key, 'updated_at', now)
  next_turn = ''
end
"""
    + _KEEP
    + _INDEX
    + """return {outcome, next_turn}
"""
)


class Take(IntEnum):
    """TAKE's answer for a waiting turn."""

    HOLDS = 1
    """It holds the conversation: its history follows."""
    WAITS = 2
    """It is queued behind the running turn."""
    GONE = 3
    """Neither: the conversation was deleted, or the turn was never admitted."""


# KEYS: ConversationKeys; ARGV: the waiting turn. Returns {HOLDS, history...} or
# {WAITS|GONE, running turn or ''}: the read a queued turn's first step makes.
TAKE_LUA = (
    bind_lua(_SCRIPT_KEYS, ("turn_id",))
    + f"""local running = redis.call('HGET', meta_key, 'running') or ''
if running == turn_id then
  local out = {{{Take.HOLDS}}}
  for _, m in ipairs(redis.call('LRANGE', history_key, 0, -1)) do out[#out + 1] = m end
  return out
end
if redis.call('LPOS', queue_key, turn_id) then return {{{Take.WAITS}, running}} end
return {{{Take.GONE}, running}}
"""
)

# KEYS: ConversationKeys; ARGV: the turn that takes them in. Returns the queued turns whose
# message may join it, in queue order; nothing unless that turn holds the conversation.
INJECTABLE_LUA = (
    bind_lua(_SCRIPT_KEYS, ("turn_id",))
    + """if redis.call('HGET', meta_key, 'running') ~= turn_id then return {} end
if redis.call('SCARD', inject_key) == 0 then return {} end
local out = {}
for _, id in ipairs(redis.call('LRANGE', queue_key, 0, -1)) do
  if redis.call('SISMEMBER', inject_key, id) == 1 then out[#out + 1] = id end
end
return out
"""
)

# KEYS: ConversationKeys. Removes the conversation; returns its running and queued turns.
DELETE_LUA = (
    bind_lua(_SCRIPT_KEYS)
    + """local out = redis.call('LRANGE', queue_key, 0, -1)
local running = redis.call('HGET', meta_key, 'running')
if running and running ~= '' then table.insert(out, 1, running) end
redis.call('DEL', owner_key, meta_key, history_key, queue_key, inject_key)
return out
"""
)

# KEYS: the running turn's state hash. Counts a message sent to join it (`inject_seq`),
# which its next step sees with its state; nothing for a turn that ended.
NOTE_INJECTED_LUA = (
    bind_lua(TurnKey)
    + f"""local status = redis.call('HGET', turn_key, 'status')
if not status or {ended_lua("status")} then return 0 end
redis.call('HINCRBY', turn_key, 'inject_seq', 1)
return 1
"""
)


@dataclass(frozen=True)
class Admitted:
    """What `admit` decided for a turn."""

    outcome: Admit
    created: bool = False
    running: str | None = None
    position: int = 0
    behind: str | None = None
    step_sent: bool = False
    """RUN: its first step was sent already (by the hand-off that gave it the turn)."""


@dataclass(frozen=True)
class ConversationView:
    """A conversation as one read found it."""

    conversation_id: str
    running_turn_id: str | None
    queued: list[str]
    messages: list[dict[str, Any]]
    updated_at: float | None
    conflicts: int

    def public(self) -> dict[str, Any]:
        return {
            "conversation_id": self.conversation_id,
            "status": "busy" if self.running_turn_id else "idle",
            "running_turn_id": self.running_turn_id,
            "queued": self.queued,
            "messages": self.messages,
            "updated_at": self.updated_at,
        }


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Conversations:
    """Every read and write of conversations."""

    def __init__(self, client: redis.Redis, *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self._admit = client.register_script(ADMIT_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._injectable = client.register_script(INJECTABLE_LUA)
        self._delete = client.register_script(DELETE_LUA)
        self._note_injected = client.register_script(NOTE_INJECTED_LUA)
        self._take = client.register_script(TAKE_LUA)
        self.sharded = isinstance(client, RedisCluster)

    def _keys(self, conversation_id: str) -> list[str]:
        keys = list(ConversationKeys.of(conversation_id))
        return keys if self.sharded else [*keys, k.CONVERSATIONS_INDEX]

    def _noted(self, conversation_id: str, now: float) -> None:
        """On a Cluster, the listing's index is on another slot: noted apart."""
        if self.sharded:
            self.redis.zadd(k.CONVERSATIONS_INDEX, {conversation_id: now})

    def admit(
        self,
        conversation_id: str,
        turn_id: str,
        mode: Multitask,
        *,
        new_bytes: int,
        max_bytes: int,
        claim: str,
        may: tuple[str, ...] = (),
        any_owner: bool = False,
    ) -> Admitted:
        """Claim a new conversation or check the caller may continue this one, enforce its
        cap, and run the turn now or as `mode` says when another turn holds it."""
        if new_bytes > max_bytes:
            raise PayloadTooLarge(f"conversation {conversation_id}", new_bytes, max_bytes)
        held = [*may, "", ""][:2]
        args = AdmitArgs(
            turn_id,
            claim,
            held[0],
            held[1],
            int(any_owner),
            _MODE[mode],
            self.ttl_s,
            time.time(),
            new_bytes,
            max_bytes,
            conversation_id,
        )
        answer = self._admit(keys=self._keys(conversation_id), args=list(args))
        outcome = Admit(int(answer[0]))
        if outcome not in (Admit.NOT_FOUND, Admit.TOO_LARGE):
            self._noted(conversation_id, args.now)
        if outcome is Admit.NOT_FOUND:
            raise ConversationNotFound(conversation_id)
        if outcome is Admit.TOO_LARGE:
            raise PayloadTooLarge(
                f"conversation {conversation_id} (its history plus this request's messages)",
                int(answer[1]),
                max_bytes,
            )
        if outcome is Admit.RUN:
            # Its history is read at its first step (TAKE), not here.
            return Admitted(outcome, created=bool(int(answer[1])))
        if outcome is Admit.BUSY:
            return Admitted(outcome, running=_text(answer[1]))
        return Admitted(
            outcome,
            created=bool(int(answer[1])),
            running=_text(answer[2]),
            position=int(answer[3]),
            behind=_text(answer[4]),
        )

    def release(self, conversation_id: str, args: ReleaseArgs) -> tuple[Release, str | None]:
        """Commit a turn's exchange and hand the conversation to the next queued turn (its
        id, if any); a turn that did not hold it just leaves the queue."""
        answer = self._release(keys=self._keys(conversation_id), args=args.argv())
        outcome = Release(int(answer[0]))
        if outcome is not Release.LEFT:
            self._noted(conversation_id, args.now)
        nxt = _text(answer[1])
        return outcome, nxt or None

    def injectable(self, conversation_id: str, turn_id: str) -> list[str]:
        """Queued turns whose message may join `turn_id`'s next round, in arrival order."""
        ids = self._injectable(keys=list(ConversationKeys.of(conversation_id)), args=[turn_id])
        return [_text(i) for i in ids]

    def note_injected(self, turn_id: str) -> bool:
        """Tell a running turn a message waits to join it; False if it has ended."""
        return bool(self._note_injected(keys=[k.turn_key(turn_id)], args=[]))

    def take(
        self, conversation_id: str, turn_id: str
    ) -> tuple[Take, list[dict[str, Any]], str | None]:
        """A waiting turn's look: whether it holds the conversation (with its history), waits
        (behind the running turn named), or is in it no more."""
        answer = self._take(keys=list(ConversationKeys.of(conversation_id)), args=[turn_id])
        outcome = Take(int(answer[0]))
        if outcome is Take.HOLDS:
            return outcome, [json.loads(m) for m in answer[1:]], turn_id
        return outcome, [], _text(answer[1]) or None

    def check_access(
        self,
        conversation_id: str,
        *,
        owner: str | None = None,
        token: str | None = None,
        any_owner: bool = False,
    ) -> None:
        """Raise ConversationNotFound unless the conversation exists and the caller may use
        it: its owner's key, its token, or an admin or operator."""
        raw = self.redis.get(k.conversation_owner_key(conversation_id))
        if raw is None:
            raise ConversationNotFound(conversation_id)
        bound = _text(raw)
        if not (any_owner or bound in held_bindings(owner, token)):
            raise ConversationNotFound(conversation_id)

    def view(self, conversation_id: str) -> ConversationView:
        keys = ConversationKeys.of(conversation_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.meta_key)
        pipe.lrange(keys.queue_key, 0, -1)
        pipe.lrange(keys.history_key, 0, -1)
        meta_raw, queue, history = pipe.execute()
        meta = {_text(f): _text(v) for f, v in meta_raw.items()}
        return ConversationView(
            conversation_id=conversation_id,
            running_turn_id=meta.get("running") or None,
            queued=[_text(q) for q in queue],
            messages=[json.loads(m) for m in history],
            updated_at=float(meta["updated_at"]) if meta.get("updated_at") else None,
            conflicts=int(meta.get("conflicts") or 0),
        )

    def listing(
        self,
        *,
        owner: str | None,
        any_owner: bool,
        limit: int,
        before: float | None = None,
    ) -> list[dict[str, Any]]:
        """The caller's conversations (all for an admin or operator), newest first."""
        top = "+inf" if before is None else f"({before}"
        rows: list[dict[str, Any]] = []
        start = 0
        wanted = binding("owner", owner) if owner else None
        # Bounded: at most ten pages of the index are read for one answer.
        for _ in range(10):
            page: list[tuple[Any, float]] = self.redis.zrevrangebyscore(  # type: ignore[assignment]
                k.CONVERSATIONS_INDEX, top, "-inf", start=start, num=limit * 2, withscores=True
            )
            if not page:
                break
            start += len(page)
            pipe = self.redis.pipeline(transaction=False)
            for cid, _score in page:
                c = _text(cid)
                pipe.get(k.conversation_owner_key(c))
                pipe.hgetall(k.conversation_meta_key(c))
                pipe.llen(k.conversation_key(c))
                pipe.llen(k.conversation_queue_key(c))
            got = pipe.execute()
            gone = []
            for i, (cid, score) in enumerate(page):
                bound, meta_raw, n_messages, n_queued = got[4 * i : 4 * i + 4]
                c = _text(cid)
                if bound is None:
                    gone.append(c)
                    continue
                if not any_owner and _text(bound) != wanted:
                    continue
                meta = {_text(f): _text(v) for f, v in meta_raw.items()}
                rows.append(
                    {
                        "conversation_id": c,
                        "status": "busy" if meta.get("running") else "idle",
                        "running_turn_id": meta.get("running") or None,
                        "queued": int(n_queued),
                        "messages": int(n_messages),
                        "updated_at": score,
                    }
                )
                if len(rows) >= limit:
                    break
            if gone:
                self.redis.zrem(k.CONVERSATIONS_INDEX, *gone)
            if len(rows) >= limit:
                break
        return rows[:limit]

    def delete(self, conversation_id: str) -> list[str]:
        """Remove the conversation; its running and queued turns, for the caller to abort."""
        ids = self._delete(keys=list(ConversationKeys.of(conversation_id)), args=[])
        self.redis.zrem(k.CONVERSATIONS_INDEX, conversation_id)
        return [_text(i) for i in ids]


__all__ = [
    "Admit",
    "Admitted",
    "ConversationKeys",
    "ConversationView",
    "Conversations",
    "Multitask",
    "Release",
    "ReleaseArgs",
    "Take",
    "binding",
    "held_bindings",
]
