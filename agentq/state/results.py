"""What `Client.run` and `Turn.result()` answer: a finished turn's result, or its typed error."""

from __future__ import annotations

from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict

from agentq.errors import HeadlessInteraction, TurnAborted, TurnFailed
from agentq.events import Event, TurnFinished
from agentq.state.turn_state import TurnState


class TurnView(TypedDict):
    """A turn as `Client.get` reads it."""

    turn_id: str
    state: TurnState
    """Its state, bookkeeping and the token's hash left out."""
    history: list[dict[str, Any]]
    """Its messages, in order (OpenAI chat format)."""
    invocations: list[dict[str, Any]]
    """The records of its settled calls (`InvocationRecord` as JSON)."""
    spend: dict[str, Any]
    """Its tokens and cost with its sub-agents', and its limits (docs/spend.md)."""


class TurnUsage(BaseModel):
    """A turn's tokens and cost, its sub-agents' included."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cost_usd: float = 0.0
    """0 when the model has no price (AGENTQ_LLM_PRICES)."""


class TurnResult(BaseModel):
    """A finished turn: its final answer, typed output, usage and history."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    turn_id: str
    status: str
    """Always "finished": a turn that ends otherwise raises instead."""
    text: str
    """The final answer's text."""
    output: Any = None
    """The agent's `output_type` instance (its JSON when the type is not known here)."""
    usage: TurnUsage
    history: list[dict[str, Any]]
    """The turn's messages, in order (OpenAI chat format)."""


def settle(
    turn_id: str, terminal: Event, view: TurnView, output_type: type[BaseModel] | None
) -> TurnResult:
    """The result of a turn that ended with `terminal`; raises for one that did not finish."""
    state = view["state"]
    if terminal.type == "turn_error":
        fields = terminal.fields
        code = str(fields.get("code") or state.get("error_code") or "error")
        error = str(fields.get("error") or state.get("error") or "")
        if code == "headless_interaction":
            raise HeadlessInteraction(
                turn_id, str(fields.get("request_id") or ""), str(fields.get("kind") or "")
            )
        raise TurnFailed(turn_id, code, error)
    if terminal.type == "turn_aborted":
        raise TurnAborted(turn_id, str(terminal.fields.get("reason") or "user"))
    value = state.get("output")
    if value is not None and output_type is not None:
        value = output_type.model_validate(value)
    text = terminal.content if isinstance(terminal, TurnFinished) else ""
    return TurnResult(
        turn_id=turn_id,
        status=str(state.get("status") or "finished"),
        text=text,
        output=value,
        usage=TurnUsage.model_validate(view["spend"]),  # its limits ignored: extra fields
        history=view["history"],
    )
