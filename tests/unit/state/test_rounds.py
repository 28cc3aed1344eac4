"""A stream worker's claim of a model round: one claim, none for a round with a result or a
turn that is over (state/rounds.py)."""

from __future__ import annotations

from agentq.models import TurnStatus
from agentq.state.rounds import RoundBegun
from agentq.state.store import TurnStore

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"}]


def _claim(store: TurnStore, worker: str, round_no: int = 0) -> RoundBegun:
    return store.begin_llm_round("t1", round_no, worker, 60_000, {"model": "m"}).outcome


def test_a_round_is_claimed_once_with_its_history(store: TurnStore) -> None:
    store.create("t1", {"status": "running"}, HISTORY)
    start = store.begin_llm_round("t1", 0, "w1", 60_000, {"model": "m"})
    assert start.outcome is RoundBegun.CLAIMED
    assert start.history == HISTORY and not start.cancelled and not start.followed
    assert [e.type for e in store.bus.replay("t1")] == ["llm_started"]
    assert _claim(store, "w2") is RoundBegun.ELSEWHERE
    # The next round is not held by this one's lease.
    assert _claim(store, "w2", 1) is RoundBegun.CLAIMED


def test_no_claim_of_a_round_with_a_result_or_of_a_turn_that_is_over(store: TurnStore) -> None:
    store.create("t1", {"status": "running"}, HISTORY)
    store.finish_llm_round("t1", 0, '{"ok": true}')
    assert _claim(store, "w1") is RoundBegun.DONE
    assert store.flag_cancel("t1", "user")[0]
    assert store.begin_llm_round("t1", 1, "w1", 60_000, {}).cancelled
    store.close("t1", TurnStatus.ABORTED, "turn_aborted", {"reason": "user"})
    assert _claim(store, "w1", 2) is RoundBegun.GONE
    assert _claim(store, "w1", 0) is RoundBegun.GONE
    assert store.begin_llm_round("lost", 0, "w1", 60_000, {}).outcome is RoundBegun.GONE
