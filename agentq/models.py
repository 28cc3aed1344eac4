"""Pydantic models for everything that crosses a process boundary.

A client's chat messages are checked when the turn starts, naming the field: what the model
server or the orchestrator would choke on mid-turn is refused up front, never failed later.
"""

from __future__ import annotations

import re
import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

# The shapes of the ids in URLs and messages, checked before any Redis key is built from one.
MAX_CALL_ID_CHARS = 128
TURN_ID = re.compile(r"[0-9a-f]{32}")
CALL_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_CALL_ID_CHARS}}}")
REQUEST_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_CALL_ID_CHARS}}}\.approval")
STREAM_ID_PART_MAX = 2**64 - 1
_STREAM_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")


def parse_stream_id(value: str) -> tuple[int, int] | None:
    """(ms, seq) of a Redis stream id ("1-0", or "0"); None past 64 bits, which fail XRANGE."""
    found = _STREAM_ID.fullmatch(value)
    if found is None:
        return None
    ms, seq = int(found.group(1)), int(found.group(2) or 0)
    if ms > STREAM_ID_PART_MAX or seq > STREAM_ID_PART_MAX:
        return None
    return ms, seq


CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_NAME_CHARS = 64
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def lone_surrogate_at(value: Any) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate (JSON's
    ``"\\ud800"``), else None: it cannot be encoded as UTF-8, so every later write fails."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return where or "body"
        elif isinstance(item, dict):
            for k, v in item.items():
                sub = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and _LONE_SURROGATE.search(k):
                    return sub
                stack.append((v, sub))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Strict(_Closed):
    model_config = ConfigDict(strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str = Field(max_length=1 << 20)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
CallId = Annotated[str, Field(pattern=f"^{CALL_ID.pattern}$")]


class FunctionCall(_Strict):
    name: str = Field(pattern=rf"^[A-Za-z0-9_.:-]{{1,{MAX_NAME_CHARS}}}$")
    arguments: str


class ToolCallMessage(_Strict):
    id: CallId
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantChatMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    tool_call_id: CallId
    content: str | list[TextPart]


_BY_ROLE: dict[str, type[_Strict]] = {
    "system": SystemMessage,
    "user": UserMessage,
    "assistant": AssistantChatMessage,
    "tool": ToolMessage,
}


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` if they are a valid start of an OpenAI chat; else ValueError naming the field.

    Every call is answered once, by the tool messages right after it: a turn never runs
    calls a client wrote."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    open_calls: set[str] = set()
    seen_calls: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}")
        if not isinstance(msg.get("content"), (str, list, type(None))):
            raise ValueError(f"{where}.content must be text or a list of parts")
        bad = lone_surrogate_at(msg)
        if bad is not None:
            raise ValueError(f"{where}.{bad}: text must be valid Unicode (a lone surrogate is not)")
        try:
            parsed = _BY_ROLE[msg["role"]].model_validate(msg)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{where}.{field}: {err['msg']}") from None
        if isinstance(parsed, ToolMessage):
            if parsed.tool_call_id not in open_calls:
                raise ValueError(
                    f"{where}.tool_call_id: answers no open call of the assistant message before it"
                )
            open_calls.discard(parsed.tool_call_id)
            continue
        if open_calls:
            raise ValueError(f"{where}: the calls {sorted(open_calls)} have no tool message")
        if isinstance(parsed, AssistantChatMessage):
            for call in parsed.tool_calls or []:
                if call.id in seen_calls:
                    raise ValueError(f"{where}.tool_calls: call id {call.id!r} is used twice")
                seen_calls.add(call.id)
                open_calls.add(call.id)
    if open_calls:
        raise ValueError(f"messages: the calls {sorted(open_calls)} have no tool message")
    return messages


def _check_text(value: str | None) -> str | None:
    if value is not None and _LONE_SURROGATE.search(value):
        raise ValueError("text must be valid Unicode (a lone surrogate is not)")
    return value


_Text = Annotated[str | None, AfterValidator(_check_text)]


ToolStatus = Literal["ok", "error", "timeout", "cancelled", "denied", "lost"]


class TurnStatus(str, Enum):
    """Where a turn is in its life; see agentq.orchestrator.machine for the transitions."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    ERROR = "error"


TERMINAL_STATUSES = frozenset(
    s.value for s in (TurnStatus.FINISHED, TurnStatus.ABORTED, TurnStatus.ERROR)
)
InteractionKind = Literal["approval", "password", "confirm", "device_code", "input"]
AbortReason = Literal["user", "disconnect", "timeout", "error", "interrupt", "rollback"]


class _Frozen(_Closed):
    model_config = ConfigDict(frozen=True)


class ToolCall(_Frozen):
    """One call the model asked for; `arguments` is the raw JSON text the model sent."""

    id: str
    name: str
    arguments: str = "{}"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class Usage(_Frozen):
    """A model round's tokens, as the provider's usage chunk counted them (or estimated)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    """Of `prompt_tokens`, those the provider read from its prompt cache."""
    reasoning_tokens: int = 0
    """Of `completion_tokens`, those spent reasoning."""
    estimated: bool = False
    """True: no usage chunk came (a server that omits it); these are the round's estimate."""
    cost_usd: float | None = None
    """Priced by AGENTQ_LLM_PRICES; None: the model has no price."""


class AssistantMessage(_Frozen):
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    reasoning_items: tuple[dict[str, Any], ...] = ()

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


class InvocationRecord(_Closed):
    """What happened to one call, kept with the turn for audit and metrics."""

    call_id: str
    tool: str
    status: ToolStatus
    task_id: str | None = None
    worker: str | None = None
    pid: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    duration_ms: int | None = None
    budget_s: float | None = None
    timeout_s: float | None = None
    overran: bool = False
    soft_limited: bool = False
    partial: bool = False
    attempt: int = 1
    waitpoint_id: str | None = None
    """Set when the call's tool ended its run with a Waitpoint (its completion or timeout)."""


class ToolResult(_Closed):
    """The settled result of one call: exactly one per call id."""

    call_id: str
    tool: str
    status: ToolStatus
    content: str
    """What the model reads."""
    error: str | None = None
    reason: str | None = None
    """For `denied`: timeout, user or policy."""
    truncated_bytes: int = 0
    record: InvocationRecord

    def to_openai(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}


class ToolResultMessage(BaseModel):
    """All settled results of one round, in the model's call order."""

    results: list[ToolResult]

    def to_openai(self) -> list[dict[str, Any]]:
        return [r.to_openai() for r in self.results]


class ToolTaskRequest(_Frozen):
    """The kwargs of an `agentq.tool.<name>` task."""

    turn_id: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    attempt: int = 1
    timeout_s: float
    soft_timeout_s: float | None
    budget_s: float
    secret_ref: str | None = None
    """Redis key of a password answer; the secret itself never travels in a message."""
    traceparent: str | None = None
    """The turn's W3C trace context when tracing is on: the call's span goes under it."""


class LlmRoundRequest(_Frozen):
    """The kwargs of an `agentq.llm.round` task."""

    # A rolling deploy runs two versions side by side: a field an older turn worker still
    # sends (tokens_estimate, dropped) must not fail the round on a newer stream worker.
    model_config = ConfigDict(frozen=True, extra="ignore")

    turn_id: str
    round_no: int
    tools_json: str = Field("[]", pattern=r"^\s*\[")
    """The tools' schemas as the JSON array sent, never parsed on the way: as objects, each
    would cost kombu a Python hook and every hop an encoding."""
    duration_left_s: float
    idle_timeout_ms: int
    model: str | None = None
    """The model the turn admitted the round for; None: the stream worker's AGENTQ_LLM_MODEL."""
    instructions: str = ""
    """The agent's instructions, sent as the system message before the history."""
    traceparent: str | None = None
    """The turn's W3C trace context when tracing is on: the round's span goes under it."""
    deployment: str | None = None
    """The deployment of `model` the fleet's capacity manager granted; None: the default."""
    lease_id: str | None = None
    """The capacity grant the stream worker gives back when the round ends."""
    max_completion_tokens: int | None = None
    """The completion the turn's and its key's budgets leave this round; None: no budget."""
    prompt_estimate: int = 0
    """The prompt's estimated tokens, for the usage of a round whose server sends none."""
    key: str | None = None
    """The name of the API key whose turn this is (its llm_finished says so, for metrics)."""
    queued_s: float = 0.0
    """How long the round waited for model capacity before it was sent."""
    output_format: dict[str, Any] | None = None
    """The Responses API's `text.format` of the agent's typed answer (its `output_type`)."""


class LlmRoundResult(_Frozen):
    ok: bool
    message: AssistantMessage | None = None
    error: str | None = None
    error_code: str | None = None
    error_type: str | None = None
    aborted: bool = False
    streamed_s: float = 0.0
    failover: bool = False
    """The deployment failed before the model said anything: another one may take the round."""


class InteractionRequest(_Frozen):
    request_id: str
    kind: InteractionKind
    call_id: str | None = None
    tool: str | None = None
    prompt: str
    timeout_ms: int = Field(gt=0)
    default: Literal["approve", "deny"] | None = None
    """Declared non-interactive default, used by headless turns."""
    created_at: float = Field(default_factory=time.time)
    answer_schema: dict[str, Any] | None = None
    """`input`: the JSON Schema an answer's value must meet (checked before it is taken)."""
    default_answer: Any = None
    """`input`: the answer a headless turn takes (`default` is then "approve")."""


class InteractionAnswer(_Closed):
    decision: Literal["approve", "deny"]
    value: _Text = Field(default=None, max_length=4096)


MAX_TURN_TOKENS = 10**10
"""A turn's `max_tokens` above this is a mistake, refused (422)."""
MAX_TURN_COST_USD = 1_000_000.0
"""A turn's `max_cost_usd` above this is a mistake, refused (422)."""

MultitaskMode = Literal["enqueue", "reject", "interrupt", "rollback", "inject"]
"""What a message to a busy conversation does (TurnRequest.multitask)."""


class TurnRequest(_Closed):
    """What a client sends to start a turn."""

    prompt: _Text = None
    messages: Annotated[list[dict[str, Any]], AfterValidator(check_messages)] | None = None
    conversation_id: str | None = Field(default=None, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    conversation_token: _Text = Field(default=None, max_length=128)
    """Continues a conversation created without a key: the token its first turn returned."""
    multitask: MultitaskMode | None = None
    """What this message does while another turn of its conversation runs (default enqueue)."""
    agent: str | None = Field(default=None, max_length=64)
    """The agent the turn runs as; unset: the model of the settings with every tool."""
    headless: bool = False
    detach: bool = False
    parent_turn_id: str | None = None
    webhook_url: str | None = Field(default=None, max_length=2048)
    """Gets a signed POST (Standard Webhooks) when the turn ends."""
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TURN_TOKENS)
    """The turn's token budget, its sub-agents' spend included; at most its agent's own."""
    max_cost_usd: float | None = Field(
        default=None, gt=0, le=MAX_TURN_COST_USD, allow_inf_nan=False
    )
    """The turn's budget in USD, its sub-agents' included; its model needs a price."""

    @model_validator(mode="after")
    def _multitask_needs_conversation(self) -> TurnRequest:
        if self.multitask is not None and not self.conversation_id:
            raise ValueError("multitask: only with a conversation_id")
        return self

    def initial_messages(self) -> list[dict[str, Any]]:
        msgs = list(self.messages or [])
        if self.prompt:
            msgs.append({"role": "user", "content": self.prompt})
        return msgs


class TurnHandle(_Frozen):
    turn_id: str
    token: str
    events_url: str
    conversation_token: str | None = None
    """Set when this turn created a conversation without a key: send it to continue it."""
    queued: bool | None = None
    """True: the turn waits behind another turn of its conversation (`position`, `behind`)."""
    position: int | None = None
    behind: str | None = None
    injected: bool | None = None
    """Inject: the message joins `turn_id`'s next round, else runs as `message_turn_id`."""
    message_turn_id: str | None = None
    conversation_id: str | None = None
    """A retry's or fork's of a conversation's turn: the conversation it goes on in."""
    branched: bool | None = None
    """True: `conversation_id` is a new branch; False: a retry replaced its source's exchange."""
    missing_workers: list[str] | None = None
    """The kinds of worker every turn needs that none answers: the turn waits for them."""


def final_content(history: list[dict[str, Any]]) -> str:
    """The content of the last assistant message: what a turn answered ("" if nothing)."""
    final: dict[str, Any] = next((m for m in reversed(history) if m.get("role") == "assistant"), {})
    return str(final.get("content") or "")
