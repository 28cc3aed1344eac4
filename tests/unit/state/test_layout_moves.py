"""An older layout's keys move into each turn's state once (state/layout.py)."""

from __future__ import annotations

import json

import fakeredis

from agentq import constants as k
from agentq.state.store import TurnStore


def test_an_older_layouts_call_records_move_into_each_turns_state_once() -> None:
    from agentq.state.layout import LAYOUT, LAYOUT_KEY, upgrade_layout

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    store.create("t2", {"status": "running"}, [])
    old = k.turn_key("t2") + ":calls"
    r.hset(old, mapping={k.DISPATCHED + "c1": '{"task_id": "a"}', k.SETTLED + "c1": "old"})
    # A newer worker settled the call meanwhile: its result stays.
    r.hset(k.turn_key("t2"), k.SETTLED + "c1", "new")
    # The records of a turn whose state is gone are dropped, not made into half a turn.
    r.hset(k.turn_key("gone") + ":calls", k.SETTLED + "c9", "x")
    assert upgrade_layout(r) == 2
    assert not r.exists(old) and not r.exists(k.turn_key("gone") + ":calls")
    assert not r.exists(k.turn_key("gone"))
    assert r.hget(k.turn_key("t2"), k.SETTLED + "c1") == b"new"
    assert store.dispatches("t2") == {"c1": {"task_id": "a"}}
    assert int(r.get(LAYOUT_KEY) or 0) == LAYOUT
    # Once per Redis: a later start of a worker does not look again.
    r.hset(old, k.SETTLED + "c2", "late")
    assert upgrade_layout(r) == 0 and r.exists(old)


def test_an_older_layouts_history_lists_move_into_each_turns_state_once() -> None:
    from agentq.state.layout import upgrade_layout

    r = fakeredis.FakeRedis()
    store = TurnStore(r)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(12)]
    store.create("t1", {"status": "running"}, [])
    r.rpush(k.turn_key("t1") + ":history", *[json.dumps(m) for m in messages])
    # A turn with a history of its own (a newer worker's) keeps it.
    store.create("t2", {"status": "running"}, [{"role": "user", "content": "new"}])
    r.rpush(k.turn_key("t2") + ":history", json.dumps({"role": "user", "content": "old"}))
    r.rpush(k.turn_key("gone") + ":history", json.dumps(messages[0]))
    assert upgrade_layout(r) == 3
    assert store.history("t1") == messages  # in order, past index 9
    assert store.history("t2") == [{"role": "user", "content": "new"}]
    assert not r.keys("*:history") and not r.exists(k.turn_key("gone"))
    # The next step appends after them.
    view = store.begin_step("t1", "s", 5000)
    assert view is not None and view.history == messages
    assert store.release_step("t1", "s", None, 5000, append=[{"role": "assistant", "content": "a"}])
    assert store.history("t1") == [*messages, {"role": "assistant", "content": "a"}]
    state = store.state("t1")
    assert state is not None and state[k.HISTORY_LEN_FIELD] == 13
    assert not [f for f in state if f.startswith(k.MESSAGE)]
