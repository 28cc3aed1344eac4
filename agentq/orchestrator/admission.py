"""A model round's admission: the fleet's capacity manager grants it a slot, or queues it.

A queued round is held state like every other wait of the turn: the turn records that it
waits, publishes `llm_queued`, and its step ends with a wakeup at the time the capacity
manager named (the next slot for the head of the queue, later for those behind). Whoever
frees or finds capacity grants the rounds at the head of the queue and wakes their turns;
nothing polls, and no thread or connection is held while a round waits. A busy answer
from the provider (429, 503, 529) brings the round back here without using up one of
the turn's retries; only `llm_queue_timeout_s` bounds how long a round waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentq.errors import ModelCapacityTimeout
from agentq.llm.capacity import Grant, capacity_for
from agentq.llm.limits import estimate_tokens
from agentq.llm.wakes import waiter_of, wake_granted
from agentq.state.turn_state import TurnState

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


def admit(ctx: StepContext, round_no: int) -> Grant | float:
    """The round's grant, or when its turn should ask again (the round waits, queued)."""
    model = ctx.model
    waiter = waiter_of(ctx.turn_id, round_no)
    waiting = ctx.state.get("llm_wait_round") == round_no
    since = float(ctx.state.get("llm_wait_since") or ctx.now) if waiting else ctx.now
    cap = capacity_for(ctx.store.redis, ctx.settings)
    # The round's prompt as spend estimated it when it recorded the round (`reserve_round`),
    # and the completion its request will allow.
    tokens = estimate_tokens(int(ctx.state.get("budget_prompt") or 0), ctx.state.get("budget_cap"))
    got = cap.acquire(
        model,
        waiter=waiter,
        owner=str(ctx.state.get("owner") or ""),
        interactive=ctx.interactive,
        tokens=tokens,
    )
    wake_granted(ctx.store, got)
    if isinstance(got, Grant):
        return got
    waited_s = ctx.now - since
    limit_s = ctx.settings.llm_queue_timeout_s
    if waited_s >= limit_s:
        wake_granted(ctx.store, cap.withdraw(model, waiter))
        raise ModelCapacityTimeout(model, waited_s)
    fields: TurnState = {"llm_wait_round": round_no, "llm_wait_since": since}
    events: list[tuple[str, dict[str, Any]]] = []
    if not waiting or ctx.state.get("llm_wait_position") != got.position:
        # `first`: this wait starts here (the metrics count rounds that had to wait by it);
        # later ones only say the round moved up the queue.
        queued = {
            "round_no": round_no,
            "model": model,
            "position": got.position,
            "wait_s": round(got.wait_ms / 1000, 1),
            "first": not waiting,
        }
        events.append(("llm_queued", queued))
        fields["llm_wait_position"] = got.position
    ctx.commit(events=events, **fields)
    return min(got.retry_at_ms / 1000, since + limit_s)


def withdraw(ctx: StepContext) -> None:
    """An ending turn's round leaves the queue at once (a grant it had not used goes back)."""
    round_no = ctx.state.get("llm_wait_round")
    # A round that was sent is the stream worker's to give back: nothing waits here.
    if round_no is None or ctx.state.get("llm_round") == round_no:
        return
    cap = capacity_for(ctx.store.redis, ctx.settings)
    wake_granted(ctx.store, cap.withdraw(ctx.model, waiter_of(ctx.turn_id, int(round_no))))
