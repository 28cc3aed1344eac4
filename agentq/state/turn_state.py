"""The turn's state: its state hash's fields (JSON) but its records, typed so mypy refuses a
misspelled field. A new field is added here first, with one line saying what it holds."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypedDict, cast

if TYPE_CHECKING:
    from typing import Unpack


class TurnState(TypedDict, total=False):
    """A turn's state fields; any may be absent (not written yet, or written None)."""

    status: str
    """`TurnStatus` value: queued, running, finished, error or aborted."""
    created_at: float
    """When the turn was stored (epoch seconds)."""
    headless: bool
    """Nobody can answer a question: an approval without a default fails the turn."""
    detach: bool
    """Nobody follows the turn's stream: its model rounds wait behind interactive ones."""
    interactive: bool
    """Set on a child turn: whether a person follows its parent (overrides detach/headless)."""
    conversation_id: str | None
    """The conversation the turn continues, whose history it starts from."""
    history_start: int
    """How many messages of the history came from the conversation (before this turn)."""
    conversation_waiting: bool
    """Queued behind another turn of its conversation (its messages in `pending_messages`)."""
    pending_messages: list[dict[str, Any]] | None
    """A waiting turn's own messages, until it runs (or joins the running turn)."""
    conversation_base_len: int
    """The conversation history's length when the turn read it, where its exchange goes."""
    conversation_replaces: str
    """A retry in place: its source, the conversation's last turn, whose exchange it replaces."""
    multitask: str | None
    """What the turn's request asked for when its conversation was busy."""
    inject_seq: int
    """Messages sent to join this running turn (multitask inject), counted by the sender."""
    inject_seen: int
    """`inject_seq` as the turn last took injected messages in."""
    injected_turns: list[str] | None
    """Queued turns whose message this turn took into its history."""
    injected_into: str
    """For a turn ended because its message joined a running turn: that turn's id."""
    parent_turn_id: str | None
    """For a child turn started by an agent call: the turn that called it."""
    parent_call_id: str
    """For a child turn: the id of the parent's call it answers."""
    parent_tool: str
    """For a child turn: the name of the parent's tool (the agent) it answers."""
    agent: str | None
    """The agent the turn runs (None: the default, every registered tool)."""
    owner: str | None
    """The key name that started the turn (None: no key)."""
    token_sha256: str
    """sha256 of the turn's control token (a child shares its parent's)."""
    webhook_url: str | None
    """Where the turn's end is delivered as a signed webhook (None: nowhere)."""
    traceparent: str
    """W3C traceparent of the turn's trace, when the turn is traced."""
    trace_caller: str | None
    """The span id of the caller that started the traced turn."""
    schedule: str
    """The schedule whose tick started the turn."""
    retry_of: str
    """The turn this one retries (orchestrator.replay): its history, settled calls reused."""
    fork_of: str
    """The turn this one forks: its history before `from_round`, perhaps edited."""
    from_round: int
    """A retry's or fork's first round of its own (1-based, as `agentq show` counts)."""
    replay_lost: list[str] | None
    """A retry's first-round calls that ran in the source unsettled: run again, or lost."""
    rerun_lost: bool
    """The retry's request asked to run every such call again."""
    model: str | None
    """The model of its rounds, instead of its agent's (a retry's or fork's override)."""
    instructions: str | None
    """The system message of its rounds, instead of its agent's (a fork's edit)."""

    started_at: float
    """When its first step ran (epoch seconds)."""
    phase: str
    """While running: "model" (a round is due or out) or "tools" (calls are out)."""
    round: int
    """How many model rounds have answered (the next round's number)."""
    round_calls: list[str] | None
    """The ids of the current round's calls, read with the state by the next step."""
    call_count: int
    """How many tool calls the turn has made since `history_start`."""
    stop_after_round: str | None
    """A stop reason (max_calls_per_turn, loop_detected) that ends the turn after this round."""
    streamed_s: float
    """Seconds spent streaming model rounds so far."""
    output_retries: int
    """How many answers the agent's output type refused (they were sent back)."""
    progress: str
    """A child turn's last phase, shown in its parent's heartbeats."""

    llm_round: int | None
    """The round last recorded as sent (None: the round goes again)."""
    llm_attempt: int
    """The attempt of `llm_round` (a stream worker that died mid-round costs one)."""
    llm_sends: int
    """How many times this attempt was sent (a send nobody picked up is sent again)."""
    llm_sent_at: float
    """When the round was last sent (0: send again at once)."""
    llm_deadline: float
    """When the round's attempt fails if no result came."""
    llm_admissions: int
    """How many capacity grants the turn's rounds took."""
    llm_deployment: str
    """The deployment the round was admitted to."""
    llm_lease: str
    """The capacity lease of the round's grant."""
    llm_wait_round: int
    """The round waiting for model capacity (or that waited last)."""
    llm_wait_since: float
    """When that round started to wait."""
    llm_wait_position: int | None
    """Its place in the capacity queue, as last told (None once granted)."""
    llm_failovers: int
    """How many deployments failed `llm_failover_round` before it said anything."""
    llm_failover_round: int
    """The round those failovers are counted for."""

    max_tokens: int | None
    """The turn's token budget from its request (its agent's may be lower)."""
    max_cost_usd: float | None
    """The turn's USD budget from its request (its agent's may be lower)."""
    budget_ancestors: list[str] | None
    """A child turn's parents, nearest last: its spend counts against their budgets too."""
    budget_reservation: str | None
    """The round sent and not yet settled in Redis (orchestrator.spend)."""
    budget_day: str
    """The UTC day (YYYYMMDD) that round counts in."""
    budget_cap: int | None
    """The completion tokens its reservation allows it (its max_completion_tokens)."""
    budget_prompt: int
    """Its prompt estimate (tokens)."""
    spent_prompt_tokens: int
    """Prompt tokens of the turn's rounds so far."""
    spent_completion_tokens: int
    """Completion tokens of the turn's rounds so far."""
    spent_cached_tokens: int
    """Of the prompt tokens, those read from the provider's cache."""
    spent_usd: float
    """What the turn's rounds cost (priced models only)."""
    spent_estimated_rounds: int
    """Rounds charged their estimate (no usage from the server, or the stream broke)."""

    ended_at: float
    """When the turn ended (epoch seconds)."""
    finished_at: float
    """When it finished with an answer."""
    finish_reason: str
    """Why it finished: stop, max_calls_per_turn, loop_detected."""
    output: Any
    """The agent's typed answer (JSON), when its agent declares an output type."""
    error: str
    """Why it ended in error."""
    error_code: str
    """The error's code (unknown_agent, invalid_output, ELLM, state_lost, ...)."""
    abort_reason: str
    """Why it was aborted (the cancel reason)."""
    end_settled: list[str] | None
    """The calls its end settled (cancelled, or not run): a retry runs them again."""

    step: str
    """constants.STEP_FIELD: the step lock, `"<token>:<until ms>"`."""
    dirty: int
    """constants.DIRTY_FIELD: 1 once the turn was woken while a step held it."""
    unsettled: int
    """constants.UNSETTLED_FIELD: calls of the batch in flight without a result."""
    cancel: str
    """constants.CANCEL_FIELD: the cancel reason, read by the scripts with the state."""
    has_children: int
    """constants.CHILDREN_FIELD: set once the turn started a child turn."""
    history_len: int
    """constants.HISTORY_LEN_FIELD: how many history messages the hash holds."""
    llm_result: dict[str, Any] | None
    """constants.LLM_RESULT_FIELD: the last round's result, until it is in the history."""
    llm_result_round: int
    """constants.LLM_RESULT_ROUND_FIELD: the last round with a result."""
    llm_taken: int | None
    """constants.LLM_TAKEN_FIELD: the round a stream worker took last."""
    llm_alive: str
    """constants.LLM_ALIVE_FIELD: that worker's lease, `"<round>:<until ms>:<worker>"`."""
    watchers: int
    """events.bus.WATCHERS_FIELD: how many followers want the live copies."""
    seq: int
    """events.bus.SEQ_FIELD: the seq of the turn's last event."""


def queued_state(sha256: str, /, **fields: Unpack[TurnState]) -> TurnState:
    """A new turn's state: queued, steered by the token of `sha256`, before its first round."""
    state: TurnState = {"status": "queued", "created_at": time.time(), "history_start": 0}
    return cast(TurnState, {**state, "token_sha256": sha256, "round": 0, "call_count": 0, **fields})
