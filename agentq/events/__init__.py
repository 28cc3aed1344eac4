"""A turn's events as typed models, one class per type, all of them `Event` (published by
`agentq.events.bus`, followed by `agentq.events.follow`).

`Event.parse` reads an event (JSON, as the workers publish it) into the class of its
`type`, so `isinstance(ev, ToolFinished)` and `ev.status` work and mypy knows the fields;
an unknown type stays a plain `Event`. Every field but the common ones may be missing
(None), and a newer worker's extra fields ride along (`ev.fields` has them all).
`TurnAbortedEvent` and `TurnErrorEvent` carry a suffix: `TurnAborted` and `TurnError`
are agentq's errors.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

TERMINAL_TYPES = frozenset({"turn_finished", "turn_aborted", "turn_error"})
"""The types that end a turn: nothing of the turn is published after one of them."""

_COMMON = frozenset(("type", "turn_id", "seq", "ts", "stream_id"))
"""The fields every event has, always written out; `Event.fields` are the others."""


class Event(BaseModel):
    """One event of a turn: `type`, `turn_id`, `seq`, `ts`, and the fields of its type."""

    model_config = ConfigDict(extra="allow")

    type: str
    turn_id: str
    seq: int = 0
    ts: float = Field(default_factory=time.time)
    stream_id: str | None = None
    cursor: str | None = Field(default=None, exclude=True)
    """Where a reader resumes right after this event (`Last-Event-ID`, `follow.Cursor`)."""
    path: list[str] = Field(default_factory=list)
    """A relayed sub-agent's event: the turn ids from the parent's direct child down to the
    turn that emitted it; [] for the turn's own."""

    @model_serializer(mode="wrap")
    def _as_published(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields the event came with and no others (no typed field as null), so what a
        reader re-sends (SSE, `--json`) is what was sent."""
        data: dict[str, Any] = handler(self)
        sent = self.model_fields_set
        return {k: v for k, v in data.items() if k in _COMMON or k in sent}

    @property
    def fields(self) -> dict[str, Any]:
        """The event's own fields (all but type, turn_id, seq, ts, stream_id), as sent."""
        return {k: v for k, v in self.model_dump().items() if k not in _COMMON}

    @property
    def relayed(self) -> bool:
        """True for a sub-agent's event relayed into its parent's stream."""
        return bool(self.path)

    @property
    def ends_turn(self) -> bool:
        """True for the followed turn's own end (a relayed sub-agent's end is not)."""
        return self.type in TERMINAL_TYPES and not self.path

    @classmethod
    def parse(cls, raw: str | bytes, stream_id: str | None = None) -> Event:
        """An event as the bus stores it, as the class of its type."""
        data = json.loads(raw)
        if stream_id is not None:
            data["stream_id"] = stream_id
        return event_from(data)


def event_from(data: dict[str, Any]) -> Event:
    """`data` as the class of its `type`; a plain `Event` for one unknown or unreadable."""
    try:
        return _TYPED.validate_python(data)
    except ValidationError:
        return Event.model_validate(data)


class TurnStarted(Event):
    type: Literal["turn_started"] = "turn_started"
    agent: str | None = None
    conversation_id: str | None = None
    parent_turn_id: str | None = None
    headless: bool | None = None
    retry_of: str | None = None
    """A retry's source turn (docs/retry.md)."""
    fork_of: str | None = None
    """A fork's source turn."""
    from_round: int | None = None
    """A retry's or fork's first round of its own (1-based)."""


class TurnQueued(Event):
    """The turn waits behind another turn of its conversation."""

    type: Literal["turn_queued"] = "turn_queued"
    position: int | None = None
    behind: str | None = None


class MessageInjected(Event):
    """A user message joined this running turn at its next model round."""

    type: Literal["message_injected"] = "message_injected"
    message_turn_id: str | None = None
    messages: int | None = None


class LlmQueued(Event):
    """A model round waits for model capacity."""

    type: Literal["llm_queued"] = "llm_queued"
    model: str | None = None
    position: int | None = None
    wait_s: int | float | None = None
    first: bool | None = None


class LlmStarted(Event):
    type: Literal["llm_started"] = "llm_started"
    model: str | None = None
    queued_ms: int | float | None = None


class LlmDelta(Event):
    """Streamed model output: `kind` "text" or "reasoning"."""

    type: Literal["llm_delta"] = "llm_delta"
    kind: str | None = None
    text: str = ""


class LlmRetry(Event):
    type: Literal["llm_retry"] = "llm_retry"
    attempt: int | None = None
    error: str | None = None
    code: str | None = None
    delay_ms: int | float | None = None


class LlmFinished(Event):
    """A model round ended: `usage` on success, `error` and `code` on failure."""

    type: Literal["llm_finished"] = "llm_finished"
    model: str | None = None
    usage: dict[str, Any] | None = None
    """prompt_tokens, completion_tokens, cached_tokens, cost_usd (where priced)."""
    finish_reason: str | None = None
    tool_calls: int | None = None
    duration_ms: int | float | None = None
    ttft_ms: int | float | None = None
    error: str | None = None
    code: str | None = None


class _CallEvent(Event):
    """The fields every event of one tool call has."""

    call_id: str | None = None
    tool: str | None = None


class ToolStarted(_CallEvent):
    type: Literal["tool_started"] = "tool_started"
    timeout_s: int | float | None = None
    child_turn_id: str | None = None
    """Set for an agent called as a tool: the child turn that runs it."""


class ToolProgress(_CallEvent):
    type: Literal["tool_progress"] = "tool_progress"
    elapsed_ms: int | float | None = None
    source: str | None = None
    """"worker" (the periodic tick), "tool" (`ctx.progress`) or "agent" (a sub-agent)."""
    message: str | None = None


class ToolFinished(_CallEvent):
    """A call settled, with one of ok, error, timeout, cancelled, denied, lost."""

    type: Literal["tool_finished"] = "tool_finished"
    status: str | None = None
    duration_ms: int | float | None = None
    overran: bool | None = None
    soft_limited: bool | None = None
    partial: bool | None = None
    worker: str | None = None
    error: str | None = None
    reason: str | None = None
    waitpoint_id: str | None = None
    """Set for a call that waited on a waitpoint (completed, timed out or cancelled)."""


class ToolWaiting(_CallEvent):
    """The call's tool ended its run with a Waitpoint: the call waits, holding nothing,
    for a completion at `callback_url` (or its timeout)."""

    type: Literal["tool_waiting"] = "tool_waiting"
    waitpoint_id: str | None = None
    timeout_s: int | float | None = None
    callback_url: str | None = None
    """`/v1/waitpoints/{id}?token=...`: the token is the capability that completes it."""
    data: Any = None
    idempotency_key: str | None = None
    tags: list[str] | None = None


class ToolDenied(_CallEvent):
    type: Literal["tool_denied"] = "tool_denied"
    reason: str | None = None


class SubturnStarted(Event):
    """The turn started a sub-agent's turn (`child_turn_id`)."""

    type: Literal["subturn_started"] = "subturn_started"
    child_turn_id: str | None = None
    agent: str | None = None
    call_id: str | None = None


class InteractionRequested(Event):
    """The turn waits for an answer (`Turn.answer(request_id, ...)`)."""

    type: Literal["interaction_requested"] = "interaction_requested"
    request_id: str = ""
    kind: str | None = None
    call_id: str | None = None
    tool: str | None = None
    prompt: str | None = None
    timeout_ms: int | None = None
    default: str | None = None
    agent: str | None = None
    answer_schema: dict[str, Any] | None = None
    """`input`: the JSON Schema the answer's value must meet."""
    default_answer: Any = None


class InteractionAnswered(Event):
    type: Literal["interaction_answered"] = "interaction_answered"
    request_id: str | None = None
    decision: str | None = None
    by: str | None = None


class InteractionTimedOut(Event):
    type: Literal["interaction_timed_out"] = "interaction_timed_out"
    request_id: str | None = None
    call_id: str | None = None
    timeout_ms: int | None = None


class TurnEnded(Event):
    """The base of the three events that end a turn (`ends_turn`: the followed turn's own)."""


class TurnFinished(TurnEnded):
    type: Literal["turn_finished"] = "turn_finished"
    content: str = ""
    """The final answer's text."""
    output: Any = None
    """The agent's typed answer (JSON) when it has an `output_type`."""
    reason: str | None = None
    rounds: int | None = None


class TurnAbortedEvent(TurnEnded):
    type: Literal["turn_aborted"] = "turn_aborted"
    reason: str | None = None
    """user, disconnect, timeout, error, interrupt or rollback."""


class TurnErrorEvent(TurnEnded):
    type: Literal["turn_error"] = "turn_error"
    code: str | None = None
    error: str | None = None
    request_id: str | None = None
    """With code headless_interaction: the request no one could answer."""
    kind: str | None = None


TypedEvent = Annotated[
    TurnStarted
    | TurnQueued
    | MessageInjected
    | LlmQueued
    | LlmStarted
    | LlmDelta
    | LlmRetry
    | LlmFinished
    | ToolStarted
    | ToolProgress
    | ToolFinished
    | ToolWaiting
    | ToolDenied
    | SubturnStarted
    | InteractionRequested
    | InteractionAnswered
    | InteractionTimedOut
    | TurnFinished
    | TurnAbortedEvent
    | TurnErrorEvent,
    Field(discriminator="type"),
]
"""The typed events as one discriminated union (for a TypeAdapter, or `match`)."""
_TYPED: TypeAdapter[Event] = TypeAdapter(TypedEvent)
EVENT_CLASSES: tuple[type[Event], ...] = get_args(get_args(TypedEvent)[0])
"""Every typed event class, one per type."""
