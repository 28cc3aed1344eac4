"""A turn's part in its conversation: admitted at its start, the history read at its first
step, messages that join it at a round, its exchange appended at its end.

One turn of a conversation runs at a time, fleet-wide (`state.conversations`). A turn is
stored first and admitted second, so the turn that holds a conversation always exists: a
holder whose state is gone or ended (its step died between its end and its hand-off) is
released on its behalf by whichever turn waits behind it, at that turn's next look.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.errors import BrokerUnavailable, ConversationBusy, ConversationNotFound
from agentq.fleet.broker import BROKER_RETRY_S, send_step
from agentq.models import TERMINAL_STATUSES, TurnStatus
from agentq.state.conversations import (
    Admit,
    Admitted,
    Conversations,
    Multitask,
    Release,
    ReleaseArgs,
    Take,
    binding,
)

if TYPE_CHECKING:
    from celery import Celery

    from agentq.orchestrator.context import StepContext
    from agentq.state.store import TurnStore
    from agentq.state.turn_state import TurnState

log = logging.getLogger("agentq.conversation")

WAITING_RECHECK_S = 15.0
"""A queued turn looks at its conversation this often; its predecessor's hand-off wakes it
at once, so this only matters when that hand-off never came."""

STUCK_AFTER_S = 5.0
"""A turn ended this long ago without handing its conversation on was stopped before it
could (its process died): worth a warning. Sooner, its own hand-off was under way."""

Aborter = Callable[[str, str], None]

_STORES: dict[int, Conversations] = {}


def conversations(store: TurnStore) -> Conversations:
    """The conversations of the store's Redis (one per client: its scripts are loaded once)."""
    found = _STORES.get(id(store.redis))
    if found is None or found.redis is not store.redis:
        found = _STORES[id(store.redis)] = Conversations(store.redis, ttl_s=store.ttl_s)
    return found


def claim_of(owner: str | None, new_token: str | None) -> str:
    return binding("owner", owner) if owner else binding("secret", str(new_token))


def admit(
    store: TurnStore,
    app: Celery,
    conversation_id: str,
    turn_id: str,
    mode: Multitask,
    *,
    new_bytes: int,
    max_bytes: int,
    claim: str,
    may: tuple[str, ...],
    any_owner: bool,
    abort: Aborter | None,
) -> Admitted:
    """Admit a stored turn to its conversation: run it now, queue it, or refuse it
    (ConversationBusy, the turn removed again: nothing of a refused request stays)."""
    convs = conversations(store)

    def decide() -> Admitted:
        return convs.admit(
            conversation_id,
            turn_id,
            mode,
            new_bytes=new_bytes,
            max_bytes=max_bytes,
            claim=claim,
            may=may,
            any_owner=any_owner,
        )

    admitted = decide()
    running = admitted.running
    if admitted.outcome is not Admit.RUN and running and not _alive(store, running):
        # The turn ahead has ended; its own hand-off is under way, or its process died
        # before it. Hand off for it now rather than wait (or refuse) behind a turn that
        # is over: the release script lets exactly one of the two act.
        if release_for(store, app, conversation_id, running) == turn_id:
            return Admitted(Admit.RUN, created=admitted.created, step_sent=True)
        if admitted.outcome is not Admit.BUSY:
            return admitted
        admitted = decide()  # refused behind a turn that is over: asked once more
        running = admitted.running
    if admitted.outcome is Admit.BUSY:
        forget(store, turn_id)
        raise ConversationBusy(conversation_id, str(running))
    if admitted.outcome is Admit.INTERRUPTED:
        reason = "rollback" if mode is Multitask.ROLLBACK else "interrupt"
        _abort(store, app, str(running), reason, abort)
    elif admitted.outcome is Admit.INJECTED:
        convs.note_injected(str(running))
    return admitted


def forget(store: TurnStore, turn_id: str) -> None:
    """Remove a turn stored for a request that was then refused."""
    pipe = store.redis.pipeline(transaction=False)
    pipe.delete(k.turn_key(turn_id))
    pipe.zrem(k.turn_index_key(turn_id), turn_id)
    pipe.zrem(k.turn_wakeups_key(turn_id), turn_id)
    pipe.execute()


def _abort(store: TurnStore, app: Celery, turn_id: str, reason: str, abort: Aborter | None) -> None:
    if abort is not None:
        abort(turn_id, reason)
        return
    store.flag_cancel(turn_id, reason)
    if store.wake_here(turn_id):
        _send(store, app, turn_id, model_first=False)


def _alive(store: TurnStore, turn_id: str) -> bool:
    return store.status(turn_id) not in (None, *TERMINAL_STATUSES)


def _send(store: TurnStore, app: Celery, turn_id: str, *, model_first: bool) -> None:
    try:
        send_step(app, turn_id, model_first=model_first)
    except BrokerUnavailable as exc:
        log.warning("%s; turn %s starts when the broker is back", exc, turn_id)
        store.wake_by(turn_id, time.time() + BROKER_RETRY_S)


def take_turn(ctx: StepContext) -> float | None:
    """A waiting turn's first look: once it holds its conversation, its history becomes the
    conversation's followed by its own messages (None: go on); else when to look again."""
    state = ctx.state
    cid = str(state.get("conversation_id"))
    convs = conversations(ctx.store)
    outcome, prior, running = convs.take(cid, ctx.turn_id)
    if outcome is Take.GONE:
        # Deleted with its conversation, or its starter died before admitting it.
        raise ConversationNotFound(cid)
    if outcome is Take.WAITS:
        if running is not None and not _alive(ctx.store, running):
            release_for(ctx.store, ctx.app, cid, running)
            return ctx.now
        return ctx.now + WAITING_RECHECK_S
    own = list(state.get("pending_messages") or [])
    ctx.stage(
        append=[*prior, *own],
        history_start=len(prior),
        conversation_base_len=len(prior),
        conversation_waiting=False,
        pending_messages=None,
    )
    return None


def take_injected(ctx: StepContext) -> None:
    """Before a new model round: messages sent to join this turn (multitask inject) are
    appended to its history, each with `message_injected`, and their turns end."""
    seq = int(ctx.state.get("inject_seq") or 0)
    if seq <= int(ctx.state.get("inject_seen") or 0):
        return
    cid = str(ctx.state.get("conversation_id"))
    taken = list(ctx.state.get("injected_turns") or [])
    ids = [i for i in conversations(ctx.store).injectable(cid, ctx.turn_id) if i not in taken]
    messages: list[dict[str, Any]] = []
    events: list[tuple[str, dict[str, Any]]] = []
    for tid in ids:
        own = (ctx.store.state(tid) or {}).get("pending_messages") or []
        messages.extend(own)
        events.append(("message_injected", {"message_turn_id": tid, "messages": len(own)}))
    # In this turn's history before they leave the queue: a crash in between leaves them
    # queued, and this turn's end takes them out (`injected_turns`), never twice.
    ctx.commit(
        append=messages, events=events, inject_seen=seq, injected_turns=[*taken, *ids] or None
    )
    for tid in ids:
        _end_injected(ctx.store, tid, ctx.turn_id)
        conversations(ctx.store).release(
            cid, ReleaseArgs(tid, 0, ctx.store.ttl_s, ctx.now, cid, False, [], [])
        )


def _end_injected(store: TurnStore, turn_id: str, into: str) -> None:
    store.close(
        turn_id,
        TurnStatus.FINISHED,
        "turn_finished",
        {"reason": "injected", "into": into, "content": "", "rounds": 0},
        finish_reason="injected",
        injected_into=into,
        pending_messages=None,
    )


def exchange_of(state: TurnState, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a turn adds to its conversation: its own messages and what followed them."""
    if state.get("conversation_waiting"):
        # Ended before it read the history (aborted as it was handed the conversation).
        return list(state.get("pending_messages") or [])
    return history[int(state.get("history_start") or 0) :]


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
        _send(store, app, nxt, model_first=True)
    return outcome, nxt


def release_for(store: TurnStore, app: Celery, conversation_id: str, turn_id: str) -> str | None:
    """Hand off the conversation of a turn that ended (or vanished) without doing so yet;
    the turn it went to, if this call handed it on."""
    snap = store.snapshot(turn_id)
    if snap is not None:
        if snap.state.get("status") not in TERMINAL_STATUSES:
            return None
        outcome, nxt = hand_off(store, app, turn_id, snap.state, snap.history)
        ended_at = float(snap.state.get("ended_at") or 0)
        if outcome is not Release.LEFT and time.time() - ended_at > STUCK_AFTER_S:
            log.warning("turn %s ended without handing its conversation on: done for it", turn_id)
        return nxt
    # Its state is gone (expired, or lost with a Redis that lost writes): nothing of it
    # can be appended; the conversation goes on without it.
    args = ReleaseArgs(turn_id, 0, store.ttl_s, time.time(), conversation_id, False, [], [])
    _, nxt = conversations(store).release(conversation_id, args)
    if nxt is not None:
        _send(store, app, nxt, model_first=True)
    return nxt


__all__ = [
    "WAITING_RECHECK_S",
    "admit",
    "conversations",
    "exchange_of",
    "hand_off",
    "release_for",
    "take_injected",
    "take_turn",
]
