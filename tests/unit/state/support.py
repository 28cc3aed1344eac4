"""What the tests of the store's scripts share: a store on fakeredis holding one running
turn, a call, and readers of the turn's bookkeeping."""

from __future__ import annotations

import json
import time
from typing import Any

import fakeredis

from agentq import constants as k
from agentq.events.bus import event_body
from agentq.models import ToolCall
from agentq.state.base import StepView
from agentq.state.store import TurnStore

CALL = ToolCall(id="c1", name="echo")


def new_store() -> TurnStore:
    """A store on fakeredis holding turn t1, running, with one user message."""
    s = TurnStore(fakeredis.FakeRedis())
    s.create("t1", {"status": "running"}, [{"role": "user", "content": "x"}])
    return s


def dirty(store: TurnStore, turn_id: str) -> bool:
    return store.redis.hget(k.turn_key(turn_id), k.DIRTY_FIELD) == b"1"


def unsettled(store: TurnStore, turn_id: str) -> int:
    return int(store.redis.hget(k.turn_key(turn_id), k.UNSETTLED_FIELD) or 0)


def lock(store: TurnStore, turn_id: str, token: str, *, lapsed: bool = False) -> None:
    """Set the step lock as a step elsewhere left it: held by `token`, or lapsed."""
    until = 1 if lapsed else int(time.time() * 1000) + 10_000
    store.redis.hset(k.turn_key(turn_id), k.STEP_FIELD, json.dumps(f"{token}:{until}"))


def holder(store: TurnStore, turn_id: str) -> str | None:
    """The token of the step that holds the turn's lock now, if any."""
    raw = store.redis.hget(k.turn_key(turn_id), k.STEP_FIELD)
    token, _, until = str(json.loads(raw) if raw else "").rpartition(":")
    return token if token and until.isdigit() and int(until) > time.time() * 1000 else None


class Capture:
    """An inline stepper that keeps the views it is handed."""

    def __init__(self) -> None:
        self.views: list[StepView] = []

    def lock_ms(self) -> int | None:
        return 5000

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        self.views.append(view)

    def wake(self, turn_id: str) -> None:
        pass


class Woken(list[str]):
    """A stepper that takes no step here and keeps the turns it is asked to wake."""

    def lock_ms(self) -> int | None:
        return None

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        raise AssertionError("no lock was taken for this process")

    def wake(self, turn_id: str) -> None:
        self.append(turn_id)


def publish_many(store: TurnStore, batches: dict[str, list[tuple[str, dict[str, Any]]]]) -> None:
    """As a stream worker publishes: event bodies of several turns in one go."""
    store.bus.publish_many(
        {t: [event_body(t, type_, f) for type_, f in events] for t, events in batches.items()}
    )
