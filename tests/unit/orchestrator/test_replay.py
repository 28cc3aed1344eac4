"""What a retry and a fork are built from a source as read: the history kept, the calls
reused, the ones run again, the refusals. Pure functions of the source: no Redis."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import pytest

from agentq import constants as k
from agentq.config import load_settings
from agentq.errors import BudgetInvalid, ForkInvalid, NotRetryable
from agentq.models import ToolCall
from agentq.orchestrator.replay import (
    BulkRetryRequest,
    ForkEdit,
    ForkRequest,
    RetryRequest,
    Source,
    _sources,
    fork_launch,
    replay_source,
    retry_launch,
)
from agentq.orchestrator.start import check_budgets
from agentq.state.listing import TurnLister, TurnPage, TurnQuery
from agentq.state.turn_state import TurnState
from agentq.tools.results import cancelled_result, lost_result

TOKEN = "t" * 43


def _call(cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "echo", "arguments": "{}"}}


def _result(cid: str, content: str = "ok") -> str:
    return json.dumps(
        {
            "call_id": cid,
            "tool": "echo",
            "status": "ok",
            "content": content,
            "record": {"call_id": cid, "tool": "echo", "status": "ok"},
        }
    )


def _source(state: TurnState, results: dict[str, str], started: set[str] = frozenset()) -> Source:
    """A turn of two rounds of calls (a1, a2; b1, b2), its second cut short."""
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [_call("a1"), _call("a2")]},
        {"role": "tool", "tool_call_id": "a1", "content": "A1"},
        {"role": "tool", "tool_call_id": "a2", "content": "A2"},
        {"role": "assistant", "content": None, "tool_calls": [_call("b1"), _call("b2")]},
        {"role": "tool", "tool_call_id": "b1", "content": "B1"},
        {"role": "tool", "tool_call_id": "b2", "content": "cancelled"},
    ]
    base: TurnState = {"status": "aborted", "round": 2, "call_count": 4, "owner": "alice"}
    return Source("f" * 32, {**base, **state}, history, results, frozenset(started))


def _all_results() -> dict[str, str]:
    return {c: _result(c, c.upper()) for c in ("a1", "a2", "b1")}


def test_a_retry_runs_only_the_calls_its_source_ended_without() -> None:
    b2 = ToolCall(id="b2", name="echo", arguments="{}")
    results = {**_all_results(), "b2": cancelled_result(b2).model_dump_json()}
    src = _source({"end_settled": ["b2"], "spent_prompt_tokens": 900}, results, {"b2"})
    new = retry_launch(src, RetryRequest(), TOKEN)
    assert [m["role"] for m in new.history] == ["user", "assistant", "tool", "tool", "assistant"]
    assert set(new.records) == {k.SETTLED + c for c in ("a1", "a2", "b1")}
    st = new.state
    assert st["retry_of"] == src.turn_id and st["from_round"] == 2 and st["round"] == 2
    assert st["round_calls"] == ["b1", "b2"] and st["replay_lost"] == ["b2"]
    assert st["spent_prompt_tokens"] == 900 and st["owner"] == "alice"
    assert "rerun_lost" not in st


def test_a_retry_of_a_fork_keeps_its_edited_instructions() -> None:
    # Its rounds go on with the system message the source's rounds had.
    src = _source({"status": "error", "instructions": "be brief"}, _all_results())
    assert retry_launch(src, RetryRequest(), TOKEN).state["instructions"] == "be brief"
    fork = fork_launch(src, ForkRequest(at_round=2, edit=ForkEdit(instructions="new")), TOKEN)
    assert fork.state["instructions"] == "new"


def test_a_call_lost_with_its_worker_is_run_again_like_one_cut_short() -> None:
    b2 = ToolCall(id="b2", name="echo", arguments="{}")
    results = {**_all_results(), "b2": lost_result(b2, "its worker died").model_dump_json()}
    new = retry_launch(_source({}, results), RetryRequest(rerun_lost=True), TOKEN)
    assert new.state["replay_lost"] == ["b2"] and new.state["rerun_lost"] is True


def test_a_retry_of_a_failed_model_round_sends_only_that_round() -> None:
    results = {**_all_results(), "b2": _result("b2")}
    src = _source({"status": "error"}, results)
    new = retry_launch(src, RetryRequest(model="other"), TOKEN)
    assert new.history == src.history
    assert new.state["from_round"] == 3 and "round_calls" not in new.state
    assert new.state["model"] == "other"


@pytest.mark.parametrize("status", ["queued", "running", "finished"])
def test_only_an_ended_error_or_aborted_turn_is_retried(status: str) -> None:
    with pytest.raises(NotRetryable) as refused:
        retry_launch(_source({"status": status}, {}), RetryRequest(), TOKEN)
    assert refused.value.status == status and refused.value.status_code == 409


def test_a_fork_keeps_the_history_before_its_round_edited() -> None:
    src = _source({}, _all_results())
    edit = ForkEdit(message="again", tool_result={"call_id": "a2", "content": "what if"})
    new = fork_launch(src, ForkRequest(at_round=2, edit=edit), TOKEN)
    assert new.history[0] == {"role": "user", "content": "again"}
    assert new.history[3]["content"] == "what if" and len(new.history) == 4
    assert json.loads(new.records[k.SETTLED + "a2"])["content"] == "what if"
    assert set(new.records) == {k.SETTLED + "a1", k.SETTLED + "a2"}
    assert new.state["fork_of"] == src.turn_id and new.state["round"] == 1
    assert new.state["call_count"] == 2
    assert src.history[0]["content"] == "go"  # the source as read is left as it was
    assert replay_source(new.state) == {"kind": "fork", "turn_id": src.turn_id, "from_round": 2}


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (ForkRequest(at_round=3), "at_round"),
        (ForkRequest(at_round=2, edit=ForkEdit(tool_result={"call_id": "b1", "content": ""})),
         "edit.tool_result.call_id"),
        (ForkRequest(at_round=1, edit=ForkEdit(tool_result={"call_id": "a1", "content": ""})),
         "edit.tool_result.call_id"),
    ],
)  # fmt: skip
def test_a_fork_refuses_what_the_history_cannot_take(req: ForkRequest, field: str) -> None:
    # Round 2's b2 has no result of its own: no round 3 follows it.
    with pytest.raises(ForkInvalid) as refused:
        fork_launch(_source({"end_settled": ["b2"]}, _all_results()), req, TOKEN)
    assert refused.value.field == field and refused.value.status_code == 422


def test_no_round_follows_one_whose_results_are_not_all_in_the_history() -> None:
    # A running turn: b2 settled in Redis, its tool message not written yet.
    src = _source({"status": "running"}, {**_all_results(), "b2": _result("b2")})
    src.history.pop()
    with pytest.raises(ForkInvalid) as refused:
        fork_launch(src, ForkRequest(at_round=3), TOKEN)
    assert "must be 1..2" in refused.value.message
    complete = _source({}, {**_all_results(), "b2": _result("b2")})
    assert fork_launch(complete, ForkRequest(at_round=3), TOKEN).history == complete.history


def test_a_bulk_retry_reads_the_listing_page_after_page() -> None:
    now = time.time()
    asked: list[float | None] = []

    class Lister:
        def page(self, query: TurnQuery, visible: Any = None) -> TurnPage:
            asked.append(query.before)
            if query.before is None:
                return TurnPage([{"turn_id": "a", "created_at": now - 1}], next_before=now - 1)
            return TurnPage([{"turn_id": "b", "created_at": now - 2}])

    req = BulkRetryRequest(status="error")
    assert list(_sources(cast(TurnLister, Lister()), req, None)) == ["a", "b"]
    assert asked == [None, now - 1]


def test_a_usd_budget_is_checked_for_the_model_a_retry_or_fork_runs() -> None:
    # The start's check prices the model the rounds use: the turn's own, not the default.
    prices = json.dumps({"priced": {"input": 1, "output": 2}})
    store = cast(Any, None)  # no agent, no key budget: nothing read from Redis
    priced = load_settings(llm_model="priced", llm_prices=prices)
    with pytest.raises(BudgetInvalid, match="no-price"):
        check_budgets(store, priced, {"model": "no-price", "max_cost_usd": 1.0}, 10)
    unpriced = load_settings(llm_model="no-price", llm_prices=prices)
    check_budgets(store, unpriced, {"model": "priced", "max_cost_usd": 1.0}, 10)
