"""A turn's part in its conversation (one turn at a time): admitted at its start, the history
read at its first step, messages that join it at a round, its exchange appended at its end
by the hand-off (docs/conversations.md, "How it works")."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import cache
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.errors import AgentqError, ConversationNotFound
from agentq.models import TERMINAL_STATUSES, TurnStatus
from agentq.orchestrator.wake import send_step_or_wake
from agentq.state.conversation_lua import InPlace, Release, ReleaseArgs, Take
from agentq.state.conversations import Conversations, ConversationView

if TYPE_CHECKING:
    from celery import Celery

    from agentq.orchestrator.context import StepContext
    from agentq.state.store import TurnStore
    from agentq.state.turn_state import TurnState

log = logging.getLogger("agentq.conversation")

WAITING_RECHECK_S = 15.0
"""A queued turn looks at its conversation this often, should its predecessor's hand-off fail."""

STUCK_AFTER_S = 5.0
"""A turn ended this long ago without handing its conversation on was stopped before it
could (its process died): worth a warning. Sooner, its own hand-off was under way."""


@cache
def conversations(store: TurnStore) -> Conversations:
    """The store's Conversations, made once per store (its scripts registered once)."""
    return Conversations(store.redis, ttl_s=store.ttl_s)


class ConversationMovedOn(AgentqError):
    """A retry's source moved on in its conversation: the retry branches (`start_replay`)."""


def admit_in_place(
    store: TurnStore, app: Celery, conversation_id: str, turn_id: str, source_id: str
) -> None:
    """Let a stored retry hold its source's conversation if the source is still its last turn
    and no other holds or waits (one script); else remove it again (ConversationMovedOn)."""
    for _ in range(2):
        outcome, running = conversations(store).admit_in_place(conversation_id, turn_id, source_id)
        if outcome is InPlace.RUN:
            return
        if outcome is InPlace.GONE or running is None or alive(store, running):
            break
        # The turn that holds it has ended (the source, say): hand off for it, look again.
        if release_for(store, app, conversation_id, running) is not None:
            break
    forget(store, turn_id)
    raise ConversationMovedOn(f"turn {source_id} is no longer the last of {conversation_id}")


def forget(store: TurnStore, turn_id: str) -> None:
    """Remove a turn stored for a request that was then refused."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.delete(k.turn_key(turn_id))
    pipe.zrem(k.shard_key(k.TURNS_INDEX, turn_id), turn_id)
    pipe.zrem(k.shard_key(k.WAKEUPS, turn_id), turn_id)
    pipe.execute()


def alive(store: TurnStore, turn_id: str) -> bool:
    return store.status(turn_id) not in (None, *TERMINAL_STATUSES)


def take_turn(ctx: StepContext) -> float | None:
    """A waiting turn's first look: once it holds its conversation, the conversation's history
    then its own messages (None: go on); else when to look again."""
    state = ctx.state
    cid = str(state.get("conversation_id"))
    outcome, prior, running = conversations(ctx.store).take(cid, ctx.turn_id)
    if outcome is Take.GONE:
        # Deleted with its conversation, or its starter died before admitting it.
        raise ConversationNotFound(cid)
    if outcome is Take.WAITS:
        if running is not None and not alive(ctx.store, running):
            release_for(ctx.store, ctx.app, cid, running)
            return ctx.now
        return ctx.now + WAITING_RECHECK_S
    ctx.stage(
        append=[*prior, *(state.get("pending_messages") or [])],
        # A branch brings its source's earlier messages: its exchange starts where the source's did.
        history_start=len(prior) + int(state.get("history_start") or 0),
        conversation_base_len=len(prior),
        conversation_waiting=False,
        pending_messages=None,
    )
    return None


def take_injected(ctx: StepContext) -> None:
    """Before a round: messages sent to join this turn (multitask inject) in, their turns ended."""
    seq = int(ctx.state.get("inject_seq") or 0)
    if seq <= int(ctx.state.get("inject_seen") or 0):
        return
    cid = str(ctx.state.get("conversation_id"))
    taken = list(ctx.state.get("injected_turns") or [])
    ids = [i for i in conversations(ctx.store).injectable(cid, ctx.turn_id) if i not in taken]
    states = {tid: ctx.store.state(tid) or {} for tid in ids}
    for tid in ids:
        own = states[tid].get("pending_messages") or []
        event = ("message_injected", {"message_turn_id": tid, "messages": len(own)})
        ctx.stage(events=[event], append=own)
    # In the history before they leave the queue: after a crash, this turn's end takes them out.
    ctx.commit(inject_seen=seq, injected_turns=[*taken, *ids] or None)
    for tid in ids:
        _end_injected(ctx.store, tid, ctx.turn_id)
        # It leaves the queue; a webhook keeps its backstop, whose step queues the delivery.
        left: TurnState = {"conversation_id": cid, "webhook_url": states[tid].get("webhook_url")}
        hand_off(ctx.store, ctx.app, tid, left, [])


def _end_injected(store: TurnStore, turn_id: str, into: str) -> None:
    store.close(
        turn_id,
        TurnStatus.FINISHED,
        "turn_finished",
        {"reason": "injected", "into": into, "content": "", "rounds": 0},
        finish_reason="injected",
        injected_into=into,
        pending_messages=None,
        hands_off=True,  # its webhook's delivery, if any: queued by the step its backstop wakes
    )


def exchange_of(state: TurnState, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a turn adds to its conversation: its own messages and what followed them."""
    if state.get("conversation_waiting"):
        # Ended before it read the history: a retry in place adds nothing, its source stays.
        if state.get("conversation_replaces"):
            return []
        # Its history holds only the results of calls its pending messages left open.
        return [*(state.get("pending_messages") or []), *history]
    base = state.get("conversation_base_len")
    return history[int(base if base is not None else state.get("history_start") or 0) :]


def hand_off(
    store: TurnStore,
    app: Celery,
    turn_id: str,
    state: TurnState,
    history: list[dict[str, Any]],
) -> tuple[Release, str | None]:
    """After a turn ended: append its exchange, then start the next queued turn (its id)."""
    cid = str(state.get("conversation_id"))
    gone = list(state.get("injected_turns") or [])
    args = ReleaseArgs(
        turn_id=turn_id,
        base_len=-1
        if state.get("conversation_waiting")
        else int(state.get("conversation_base_len") or 0),
        ttl_s=store.ttl_s,
        now=time.time(),
        conversation_id=cid,
        rolled_back=state.get("abort_reason") == "rollback",
        gone=gone,
        messages=[json.dumps(m) for m in exchange_of(state, history)],
    )
    outcome, nxt = conversations(store).release(cid, args)
    if outcome is Release.CONFLICT:
        log.error(
            "conversation %s: its history changed under turn %s (appended after it all the same)",
            cid,
            turn_id,
        )
    for tid in gone:
        _end_injected(store, tid, turn_id)
    if nxt is not None:
        send_step_or_wake(store, app, nxt)
    if not state.get("webhook_url"):
        # Handed on: the backstop its end left goes (a webhook's goes once it is queued).
        store.redis.zrem(k.shard_key(k.WAKEUPS, turn_id), turn_id)
    return outcome, nxt


def shown(store: TurnStore, view: ConversationView) -> ConversationView:
    """The conversation as a reader should see it: once its running turn ended, as that turn's
    hand-off (a second write, perhaps not done yet) leaves it. A read writes nothing."""
    running = view.running_turn_id
    # Its status first: the whole state is read only for a turn that has ended.
    if not running or store.status(running) not in TERMINAL_STATUSES:
        return view
    snap = store.snapshot(running)
    if snap is None:
        return view
    state = snap.state
    kept = [] if state.get("abort_reason") == "rollback" else exchange_of(state, snap.history)
    before = view.messages
    if kept and state.get("conversation_replaces"):
        # A retry in place: its exchange replaces its source's, the history's tail.
        before = before[: int(state.get("conversation_base_len") or 0)]
    gone = set(state.get("injected_turns") or [])
    queue = [t for t in view.queued if t not in gone and t != running]
    return dataclasses.replace(
        view,
        running_turn_id=queue[0] if queue else None,
        queued=queue[1:],
        messages=[*before, *kept],
    )


def release_for(store: TurnStore, app: Celery, conversation_id: str, turn_id: str) -> str | None:
    """Hand off for a turn that ended or vanished without it; the next turn, if this handed on."""
    snap = store.snapshot(turn_id)
    if snap is None:
        # Its state expired or was lost: the conversation goes on without its exchange.
        return hand_off(store, app, turn_id, {"conversation_id": conversation_id}, [])[1]
    if snap.state.get("status") not in TERMINAL_STATUSES:
        return None
    outcome, nxt = hand_off(store, app, turn_id, snap.state, snap.history)
    ended_at = float(snap.state.get("ended_at") or 0)
    if outcome is not Release.LEFT and time.time() - ended_at > STUCK_AFTER_S:
        log.warning("turn %s ended without handing its conversation on: done for it", turn_id)
    return nxt
