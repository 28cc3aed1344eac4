"""The position of a reader that relays sub-agents: encoded in one SSE id, parsed strictly."""

from __future__ import annotations

import pytest

from agentq.events.follow import CURSOR_CHILDREN_MAX, Cursor

CHILD = "a" * 32
GRANDCHILD = "b" * 32


def test_a_cursor_without_open_children_is_a_plain_stream_id() -> None:
    assert Cursor("5-1").encode() == "5-1"
    assert Cursor.parse("5-1") == Cursor("5-1", {})
    assert Cursor.parse("7") == Cursor("7-0", {})


def test_a_cursor_round_trips_every_open_stream() -> None:
    cur = Cursor("5-1", {CHILD: "6-0", GRANDCHILD: "0-0"})
    raw = cur.encode()
    assert raw == f"5-1,{CHILD}=6-0,{GRANDCHILD}=0-0"
    assert Cursor.parse(raw) == cur


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "yesterday",
        "1-0-0",
        "99999999999999999999999-0",
        f"1-0,{CHILD}",
        f"1-0,{CHILD}=x",
        "1-0,NOTHEX=1-0",
        f"1-0,{CHILD}=1-0,",
    ],
)
def test_a_bad_cursor_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        Cursor.parse(raw)


def test_a_cursor_names_a_bounded_number_of_streams() -> None:
    many = "".join(f",{i:032x}=1-0" for i in range(CURSOR_CHILDREN_MAX + 1))
    with pytest.raises(ValueError, match="more than"):
        Cursor.parse("1-0" + many)
