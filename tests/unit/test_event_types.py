"""Typed events: each type reads into its class, and what is written back is what was sent."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from agentq.events import (
    EVENT_CLASSES,
    Event,
    LlmFinished,
    SubturnStarted,
    ToolFinished,
    TurnEnded,
    TurnErrorEvent,
    TurnFinished,
    TypedEvent,
    event_from,
)

SENT = {
    "type": "tool_finished",
    "turn_id": "a" * 32,
    "seq": 7,
    "ts": 1.5,
    "call_id": "c1",
    "tool": "word_count",
    "status": "ok",
    "duration_ms": 12,
    "overran": False,
    "added_later": {"x": 1},
}


def test_an_event_reads_into_the_class_of_its_type() -> None:
    ev = Event.parse(json.dumps(SENT), stream_id="1-0")
    assert isinstance(ev, ToolFinished)
    assert (ev.status, ev.tool, ev.duration_ms, ev.stream_id) == ("ok", "word_count", 12, "1-0")
    assert ev.fields["added_later"] == {"x": 1}


def test_what_is_written_back_is_what_was_sent() -> None:
    ev = Event.parse(json.dumps(SENT))
    # Declared fields the event lacks (error, worker, ...) are not written out as null.
    assert ev.model_dump(mode="json") == {**SENT, "stream_id": None}
    assert json.loads(ev.model_dump_json()) == {**SENT, "stream_id": None}
    assert ev.fields == {k: v for k, v in SENT.items() if k not in ("type", "turn_id", "seq", "ts")}


def test_every_type_has_one_class_and_the_union_agrees() -> None:
    types = [c.model_fields["type"].default for c in EVENT_CLASSES]
    assert len(types) == len(set(types)) == 20
    adapter: TypeAdapter[Event] = TypeAdapter(TypedEvent)
    for cls, type_ in zip(EVENT_CLASSES, types, strict=True):
        body = {"type": type_, "turn_id": "t", "seq": 1, "ts": 1.0}
        assert type(event_from(body)) is cls
        assert type(adapter.validate_python(body)) is cls


def test_an_unknown_type_or_unreadable_fields_stay_a_plain_event() -> None:
    assert type(event_from({"type": "from_the_future", "turn_id": "t"})) is Event
    odd = event_from({"type": "tool_finished", "turn_id": "t", "status": {"not": "text"}})
    assert type(odd) is Event
    assert odd.fields["status"] == {"not": "text"}


@pytest.mark.parametrize("type_", ["turn_finished", "turn_aborted", "turn_error"])
def test_a_turns_own_end_is_told_from_a_relayed_one(type_: str) -> None:
    own = event_from({"type": type_, "turn_id": "t"})
    relayed = own.model_copy(update={"path": ["child"]})
    assert isinstance(own, TurnEnded)
    assert own.ends_turn and not own.relayed
    assert relayed.relayed and not relayed.ends_turn
    assert relayed.model_dump()["path"] == ["child"]


def test_typed_fields_of_the_events_a_client_reads_most() -> None:
    done = event_from(
        {"type": "turn_finished", "turn_id": "t", "content": "hi", "output": {"n": 2}}
    )
    assert isinstance(done, TurnFinished) and done.content == "hi" and done.output == {"n": 2}
    err = event_from({"type": "turn_error", "turn_id": "t", "code": "budget_exceeded"})
    assert isinstance(err, TurnErrorEvent) and err.code == "budget_exceeded"
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    llm = event_from({"type": "llm_finished", "turn_id": "t", "usage": usage})
    assert isinstance(llm, LlmFinished) and llm.usage == usage
    sub = event_from({"type": "subturn_started", "turn_id": "t", "child_turn_id": "c"})
    assert isinstance(sub, SubturnStarted) and sub.child_turn_id == "c"
