"""Conversations: one history that successive turns append to, one turn at a time. Its keys
and how a turn is admitted are docs/conversations.md's; its scripts are in `conversation_lua`."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from agentq import constants as k
from agentq.errors import ConversationNotFound, PayloadTooLarge
from agentq.events.lua_args import LuaScript
from agentq.models import MultitaskMode
from agentq.state.base import text
from agentq.state.conversation_lua import (
    ADMIT_LUA,
    DELETE_LUA,
    IN_PLACE_LUA,
    NOTE_INJECTED_LUA,
    READ_LUA,
    RELEASE_LUA,
    Admit,
    AdmitArgs,
    ConversationKeys,
    InPlace,
    InPlaceArgs,
    Release,
    ReleaseArgs,
    Take,
)


def binding(kind: str, value: str) -> str:
    return f"{kind}:{hashlib.sha256(value.encode()).hexdigest()}"


def held_bindings(owner: str | None, token: str | None) -> tuple[str, ...]:
    """The bindings a caller holds: its key's, and its conversation token's."""
    return tuple(binding(kind, v) for kind, v in (("owner", owner), ("secret", token)) if v)


@dataclass(frozen=True)
class Admitted:
    """What `admit` decided for a turn."""

    outcome: Admit
    created: bool = False
    running: str | None = None
    position: int = 0
    behind: str | None = None


@dataclass(frozen=True)
class ConversationView:
    """A conversation as one read found it."""

    conversation_id: str
    running_turn_id: str | None
    queued: list[str]
    messages: list[dict[str, Any]]
    updated_at: float | None

    def public(self) -> dict[str, Any]:
        status = "busy" if self.running_turn_id else "idle"
        return {"conversation_id": self.conversation_id, "status": status, **vars(self)}


class Conversations:
    """Every read and write of conversations."""

    _admit = LuaScript(ADMIT_LUA)
    _release = LuaScript(RELEASE_LUA)
    _delete = LuaScript(DELETE_LUA)
    _note_injected = LuaScript(NOTE_INJECTED_LUA)
    _read = LuaScript(READ_LUA)
    _in_place = LuaScript(IN_PLACE_LUA)

    def __init__(self, client: redis.Redis, *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.sharded = isinstance(client, RedisCluster)

    def _keys(self, conversation_id: str) -> list[str]:
        keys = list(ConversationKeys.of(conversation_id))
        return keys if self.sharded else [*keys, k.CONVERSATIONS_INDEX]

    def _noted(self, conversation_id: str, now: float) -> None:
        if self.sharded:
            self.redis.zadd(k.CONVERSATIONS_INDEX, {conversation_id: now})

    def _look(
        self, conversation_id: str, history: bool = True
    ) -> tuple[dict[str, str], list[str], set[str], list[Any]]:
        """Its meta, queue, injectable turns and history (if asked), as one moment's."""
        keys = ConversationKeys.of(conversation_id)
        meta, queue, inject, messages = self._read(keys=keys, args=[int(history)])
        return (
            {text(f): text(v) for f, v in zip(meta[::2], meta[1::2], strict=True)},
            [text(q) for q in queue],
            {text(i) for i in inject},
            [json.loads(m) for m in messages],
        )

    def admit(
        self,
        conversation_id: str,
        turn_id: str,
        mode: MultitaskMode,
        *,
        new_bytes: int,
        max_bytes: int,
        claim: str,
        may: tuple[str, ...] = (),
        any_owner: bool = False,
    ) -> Admitted:
        """Admit a turn (a new conversation claimed, within its cap): run it, or as `mode` says."""
        held = [*may, "", ""][:2]
        args = AdmitArgs(
            turn_id,
            claim,
            held[0],
            held[1],
            int(any_owner),
            mode,
            self.ttl_s,
            time.time(),
            new_bytes,
            max_bytes,
            conversation_id,
        )
        answer = self._admit(keys=self._keys(conversation_id), args=list(args))
        outcome = Admit(int(answer[0]))
        if outcome is Admit.NOT_FOUND:
            raise ConversationNotFound(conversation_id)
        if outcome is Admit.TOO_LARGE:
            raise PayloadTooLarge(
                f"conversation {conversation_id} (its history plus this request's messages)",
                int(answer[1]),
                max_bytes,
            )
        self._noted(conversation_id, args.now)
        _, created, running, position, behind = answer
        running, behind = text(running) or None, text(behind) or None
        return Admitted(outcome, bool(int(created)), running, int(position), behind)

    def admit_in_place(
        self, conversation_id: str, turn_id: str, source_id: str
    ) -> tuple[InPlace, str | None]:
        """Let a stored retry hold the conversation to replace its last turn `source_id`'s
        exchange, if no other turn holds or waits for it (the running turn, if one does)."""
        args = InPlaceArgs(turn_id, source_id, self.ttl_s, time.time(), conversation_id)
        answer = self._in_place(keys=self._keys(conversation_id), args=list(args))
        outcome = InPlace(int(answer[0]))
        if outcome is InPlace.RUN:
            self._noted(conversation_id, args.now)
        return outcome, text(answer[1]) or None

    def release(self, conversation_id: str, args: ReleaseArgs) -> tuple[Release, str | None]:
        """Commit a turn's exchange and hand the conversation on (the next turn's id, if any)."""
        answer = self._release(keys=self._keys(conversation_id), args=args.argv())
        outcome = Release(int(answer[0]))
        if outcome is not Release.LEFT:
            self._noted(conversation_id, args.now)
        return outcome, text(answer[1]) or None

    def injectable(self, conversation_id: str, turn_id: str) -> list[str]:
        """Queued turns whose message may join `turn_id`'s next round, in arrival order."""
        meta, queue, inject, _ = self._look(conversation_id, history=False)
        return [t for t in queue if t in inject] if meta.get("running") == turn_id else []

    def note_injected(self, turn_id: str) -> bool:
        """Tell a running turn a message waits to join it; False if it has ended."""
        return bool(self._note_injected(keys=[k.turn_key(turn_id)], args=[]))

    def take(
        self, conversation_id: str, turn_id: str
    ) -> tuple[Take, list[dict[str, Any]], str | None]:
        """Whether a waiting turn holds its conversation (its history) or waits (behind whom)."""
        meta, queue, _, history = self._look(conversation_id)
        running = meta.get("running") or None
        if running != turn_id:
            return (Take.WAITS if turn_id in queue else Take.GONE), [], running
        # A retry in place reads the history before the exchange it replaces.
        upto = int(meta["last_base"]) if meta.get("replacing") == turn_id else None
        return Take.HOLDS, history[:upto], turn_id

    def check_access(
        self,
        conversation_id: str,
        *,
        owner: str | None = None,
        token: str | None = None,
        any_owner: bool = False,
    ) -> None:
        """ConversationNotFound unless the caller may use it (its key, its token, an admin)."""
        raw = self.redis.get(k.conversation_key(conversation_id, "owner"))
        if raw is None or not (any_owner or text(raw) in held_bindings(owner, token)):
            raise ConversationNotFound(conversation_id)

    def view(self, conversation_id: str) -> ConversationView:
        meta, queue, _, history = self._look(conversation_id)
        updated_at = float(meta["updated_at"]) if meta.get("updated_at") else None
        return ConversationView(
            conversation_id, meta.get("running") or None, queue, history, updated_at
        )

    def listing(
        self, *, owner: str | None, any_owner: bool, limit: int, before: float | None = None
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
            pipe = self.redis.pipeline(transaction=False)
            for cid, _score in page:
                c = text(cid)
                pipe.get(k.conversation_key(c, "owner"))
                pipe.hget(k.conversation_key(c, "meta"), "running")
                pipe.llen(k.conversation_key(c))
                pipe.llen(k.conversation_key(c, "queue"))
            got = pipe.execute()
            gone = [text(cid) for i, (cid, _) in enumerate(page) if got[4 * i] is None]
            for i, (cid, score) in enumerate(page):
                bound, running, n_messages, n_queued = got[4 * i : 4 * i + 4]
                if bound is None or not (any_owner or text(bound) == wanted):
                    continue
                running = text(running or "") or None
                rows.append(
                    {
                        "conversation_id": text(cid),
                        "status": "busy" if running else "idle",
                        "running_turn_id": running,
                        "queued": int(n_queued),
                        "messages": int(n_messages),
                        "updated_at": score,
                    }
                )
            if gone:
                self.redis.zrem(k.CONVERSATIONS_INDEX, *gone)
            # The entries pruned here are out of the index: the next page starts that much sooner.
            start += len(page) - len(gone)
            if len(rows) >= limit:
                break
        return rows[:limit]

    def delete(self, conversation_id: str) -> list[str]:
        """Remove the conversation; its running and queued turns, for the caller to abort."""
        ids = self._delete(keys=ConversationKeys.of(conversation_id), args=[])
        self.redis.zrem(k.CONVERSATIONS_INDEX, conversation_id)
        return [text(i) for i in ids]
