"""The live view of `agentq run` folds events into lines: progress shows while a tool runs."""

from __future__ import annotations

import io

from rich.console import Console

from agentq.cli.render import TurnView, progress_text
from agentq.events import Event


def ev(seq: int, type_: str, **fields: object) -> Event:
    return Event.model_validate(
        {"type": type_, "turn_id": "t", "seq": seq, "ts": 100.0 + seq, **fields}
    )


def shown(view: TurnView) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(view.render())
    return out.getvalue()


def test_progress_text_clamps_and_skips_what_is_missing() -> None:
    assert progress_text("indexing", 41.6) == "indexing 42%"
    assert progress_text("", 250) == "100%"
    assert progress_text("half", None) == "half"
    assert progress_text(None, float("nan")) == ""


def test_the_live_view_shows_a_tools_progress_until_it_finishes() -> None:
    view = TurnView()
    view.apply(ev(1, "tool_started", call_id="c1", tool="crawl"))
    view.apply(
        ev(
            2,
            "tool_progress",
            call_id="c1",
            tool="crawl",
            message="page 3 of 10",
            pct=30,
            source="tool",
            elapsed_ms=900,
        )
    )
    # The worker's own heartbeat tick carries no message: it must not erase the tool's.
    view.apply(
        ev(
            3,
            "tool_progress",
            call_id="c1",
            tool="crawl",
            state="running",
            source="worker",
            elapsed_ms=1000,
        )
    )
    assert "page 3 of 10 30%" in shown(view)
    view.apply(ev(4, "tool_finished", call_id="c1", tool="crawl", status="ok", duration_ms=1500))
    text = shown(view)
    assert "page 3 of 10" not in text and "ok" in text


def test_the_live_view_shows_what_an_agent_call_is_doing() -> None:
    view = TurnView()
    view.apply(ev(1, "tool_started", call_id="c1", tool="ask_researcher", child_turn_id="k"))
    view.apply(
        ev(
            2,
            "tool_progress",
            call_id="c1",
            tool="ask_researcher",
            message="calling search, fetch",
            pct=None,
            source="agent",
            child_turn_id="k",
            elapsed_ms=400,
        )
    )
    assert "calling search, fetch" in shown(view)


def test_the_live_view_says_a_round_waits_for_model_capacity_until_it_starts() -> None:
    view = TurnView()
    view.apply(ev(1, "llm_queued", round_no=0, model="m", position=3, wait_s=1.5))
    assert "waiting for model capacity (position 3, about 1.5s)" in shown(view)
    view.apply(ev(2, "llm_queued", round_no=0, model="m", position=1, wait_s=0.2))
    assert "position 1" in shown(view) and "position 3" not in shown(view)
    view.apply(ev(3, "llm_started", round_no=0))
    assert "waiting for model capacity" not in shown(view)


def test_a_sub_agents_tools_and_requests_nest_under_its_agent_call() -> None:
    view = TurnView()
    view.apply(ev(1, "tool_started", call_id="c1", tool="ask_researcher", child_turn_id="k"))
    view.apply(ev(2, "tool_started", call_id="c2", tool="ask_other", child_turn_id="k2"))
    # The child's call ids may repeat the parent's: its events are folded apart, by path.
    view.apply(ev(1, "tool_started", call_id="c1", tool="search", path=["k"]))
    view.apply(ev(2, "tool_started", call_id="c9", tool="lookup", path=["k", "g"]))
    view.apply(
        ev(3, "interaction_requested", request_id="c1.approval", prompt="run search?",
           timeout_ms=60_000, agent="researcher", path=["k"])
    )  # fmt: skip
    text = shown(view)
    lines = text.splitlines()
    parent = next(i for i, s in enumerate(lines) if "ask_researcher" in s)
    child = next(i for i, s in enumerate(lines) if "└ search" in s)
    assert parent < child, text
    assert "lookup" not in text  # its parent line is unknown: nothing to nest it under
    assert "? [researcher] run search?" in text
    view.apply(ev(4, "tool_finished", call_id="c1", tool="search", status="ok", path=["k"]))
    view.apply(ev(5, "interaction_answered", request_id="c1.approval", path=["k"]))
    view.apply(ev(6, "turn_finished", path=["k"]))
    assert view.outcome is None  # the child's end is not the turn's
    assert view.tools["c1"].status is None and view.tools["c1"].sub is not None
    assert view.tools["c1"].sub.tools["c1"].status == "ok"
    assert "run search?" not in shown(view)
    assert view.summary().endswith("2 running")
