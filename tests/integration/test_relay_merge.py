"""The relay's merge against a real Redis, with events published by hand: pages, order,
nesting, the parent's end, cursors, and the live part."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest

from agentq import constants as k
from agentq.events import Event
from agentq.events import follow as follow_mod
from agentq.events.bus import EventBus
from agentq.events.follow import Cursor, follow
from agentq.fleet.runtime import get_store
from agentq.local.processes import wait_for

pytestmark = pytest.mark.integration


def new_turn(bus: EventBus, parent: str | None = None) -> str:
    """A running turn (events are published only to turns Redis holds)."""
    turn_id = uuid.uuid4().hex
    fields = {"status": json.dumps("running")}
    if parent is not None:
        fields["parent_turn_id"] = json.dumps(parent)
    bus.redis.hset(k.turn_key(turn_id), mapping=fields)
    return turn_id


def ids(events: list[Event | None]) -> list[tuple[str, str, int]]:
    return [(e.type, e.turn_id, e.seq) for e in events if e is not None]


def test_logs_merge_in_publish_order_across_pages_and_levels(
    agentq_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_mod, "PAGE", 3)  # every stream is read in many pages
    bus = get_store().bus
    root = new_turn(bus)
    child = new_turn(bus, root)
    grandchild = new_turn(bus, child)
    published: list[tuple[str, str]] = []

    def pub(turn: str, type_: str, **fields: Any) -> None:
        bus.publish(turn, type_, **fields)
        published.append((turn, type_))

    pub(root, "turn_started")
    pub(root, "subturn_started", child_turn_id=child)
    for i in range(7):
        pub(child, "tool_progress", i=i)
        pub(root, "tool_progress", i=i)
    pub(child, "subturn_started", child_turn_id=grandchild)
    for i in range(5):
        pub(grandchild, "llm_delta", text=str(i))
    pub(grandchild, "turn_finished")
    pub(child, "turn_finished")
    pub(root, "tool_finished")
    pub(root, "turn_finished")
    # After the root's end: never relayed.
    bus.publish(child, "tool_progress", late=True)

    deep = [e for e in follow(bus, root, depth=2, live=False) if e is not None]
    for turn in (root, child, grandchild):
        assert [e.type for e in deep if e.turn_id == turn] == [t for p, t in published if p == turn]
    # Stream ids order the merge by millisecond (their sequence parts count per stream);
    # within one, the deeper stream first: a child's end before what it settles above.
    ms = [int((e.stream_id or "0-0").split("-")[0]) for e in deep]
    assert ms == sorted(ms)
    where = {(e.turn_id, e.type): i for i, e in enumerate(deep)}
    assert where[(grandchild, "turn_finished")] < where[(child, "turn_finished")]
    assert where[(child, "turn_finished")] < where[(root, "tool_finished")]
    paths = {e.turn_id: e.path for e in deep}
    assert paths == {root: [], child: [child], grandchild: [child, grandchild]}
    one = [e for e in follow(bus, root, depth=1, live=False) if e is not None]
    assert ids(one) == [i for i in ids(deep) if i[1] != grandchild]
    none = [e for e in follow(bus, root, live=False) if e is not None]
    assert {e.turn_id for e in none} == {root}
    # Resuming from any event's cursor gives exactly the rest, at every depth.
    for i in range(len(deep)):
        cursor = deep[i].cursor or ""
        rest = [e for e in follow(bus, root, after=cursor, depth=2, live=False) if e]
        assert ids(rest) == ids(deep[i + 1 :]), (i, cursor)


def test_a_cursor_never_opens_a_turn_outside_the_tree(agentq_env: Any) -> None:
    bus = get_store().bus
    root, stranger = new_turn(bus), new_turn(bus)
    bus.publish(stranger, "turn_started", secret="theirs")
    bus.publish(root, "turn_started")
    bus.publish(root, "turn_finished")
    forged = Cursor("0-0", {stranger: "0-0"})
    got = [e for e in follow(bus, root, after=forged, depth=8, live=False) if e]
    assert {e.turn_id for e in got} == {root}


def test_live_child_events_arrive_relayed_and_stop_at_the_parents_end(agentq_env: Any) -> None:
    bus = get_store().bus
    root = new_turn(bus)
    child = new_turn(bus, root)
    got: list[Event] = []
    done = threading.Event()

    def run() -> None:
        for ev in follow(bus, root, depth=1, heartbeat_s=0.1):
            if ev is not None:
                got.append(ev)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: bus.redis.hget(k.turn_key(root), "watchers") == b"1", 5)
    bus.publish(child, "llm_delta", text="before it is known")  # read from its log
    bus.publish(root, "subturn_started", child_turn_id=child)
    wait_for(lambda: bus.redis.hget(k.turn_key(child), "watchers") == b"1", 5)
    for i in range(50):
        bus.publish(child, "llm_delta", text=str(i))
    bus.publish(root, "turn_finished")
    assert done.wait(10)
    t.join(5)
    bus.publish(child, "turn_finished")
    relayed = [e for e in got if e.path]
    assert [e.fields["text"] for e in relayed] == ["before it is known", *map(str, range(50))]
    assert got[-1].type == "turn_finished" and got[-1].turn_id == root
    # The follower counted itself out of the child with the rest.
    assert bus.redis.hget(k.turn_key(child), "watchers") is None


def _next_ms() -> None:
    """Wait for the clock's next millisecond: stream ids then order the next publish."""
    now = int(time.time() * 1000)
    while int(time.time() * 1000) == now:
        pass


def test_a_child_found_live_does_not_jump_ahead_of_what_its_parent_published_first(
    agentq_env: Any,
) -> None:
    bus = get_store().bus
    root = new_turn(bus)
    child = new_turn(bus, root)
    bus.publish(root, "turn_started")
    events = follow(bus, root, depth=1, heartbeat_s=0.05)
    first = next(e for e in events if e is not None)  # from the log; live from here
    assert first.type == "turn_started"
    # All published before the reader takes the first live copy: the parent announces
    # the child and starts its call, then the child starts and ends, then the parent.
    for turn, type_, fields in [
        (root, "subturn_started", {"child_turn_id": child}),
        (root, "tool_started", {"call_id": "c1", "child_turn_id": child}),
        (child, "turn_started", {}),
        (child, "turn_finished", {}),
        (root, "turn_finished", {}),
    ]:
        _next_ms()
        bus.publish(turn, type_, **fields)
    rest = [(e.turn_id == child, e.type) for e in events if e is not None]
    assert rest == [
        (False, "subturn_started"),
        (False, "tool_started"),
        (True, "turn_started"),
        (True, "turn_finished"),
        (False, "turn_finished"),
    ]
