"""Waking the turns a capacity decision granted, and the next head of the queue on time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentq import constants as k

if TYPE_CHECKING:
    from agentq.llm.capacity import Wakes
    from agentq.state.store import TurnStore


def waiter_of(turn_id: str, round_no: int) -> str:
    """The capacity queue's id of a turn's model round."""
    return f"{turn_id}:{round_no}"


def turn_of(waiter: str) -> str:
    return waiter.rsplit(":", 1)[0]


def wake_granted(store: TurnStore, wakes: Wakes) -> None:
    """Wake the turns whose rounds were just granted, and set the wakeups of those given a
    later slot, and of the turn now at the head of the queue, to when their slots open
    (earlier wakeups stay)."""
    for waiter in wakes.woken:
        store.wake(turn_of(waiter))
    due = [*wakes.later, *([wakes.wake_next] if wakes.wake_next is not None else [])]
    for at in due:
        turn_id = turn_of(at.waiter)
        store.redis.zadd(k.turn_wakeups_key(turn_id), {turn_id: at.at_ms / 1000}, xx=True, lt=True)
