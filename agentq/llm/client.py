"""The Chat Completions wire format: the request body, a stream's chunks assembled into
one assistant message, and the SDK's errors as agentq's (`agentq.llm.aclient` streams)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import openai

from agentq.errors import (
    MalformedStreamChunk,
    ModelBusy,
    ModelHTTPError,
)
from agentq.llm.headers import BUSY_STATUSES, parse_retry_after, rate_headers
from agentq.llm.retry import retryable_status
from agentq.models import AssistantMessage, ToolCall, Usage

DeltaCallback = Callable[[str, str], None]
"""(kind, text): kind is "text" or "reasoning"."""

Tools = list[dict[str, Any]] | str
"""Tool schemas: a list, or the JSON array text of one (the stream worker's form)."""


def api_error_to_llm(exc: openai.APIStatusError) -> ModelHTTPError:
    """The agentq error for an error answer, with the server's own message."""
    body = exc.body
    message = exc.message
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        message = body["message"]
    if exc.status_code in BUSY_STATUSES:
        headers = exc.response.headers
        return ModelBusy(
            exc.status_code, message, parse_retry_after(headers), rate_headers(headers)
        )
    return ModelHTTPError(exc.status_code, message, retryable_status(exc.status_code))


CHAT_COMPLETIONS_PATH = "/chat/completions"


def chat_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: Tools,
    max_completion_tokens: int | None = None,
) -> bytes:
    """The streamed chat-completions request body, encoded: `chat.completions.create`'s
    per-request transform cost a busy stream worker a fifth of its CPU, so the schemas are
    spliced in as the text the turn encoded once per tool set."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_completion_tokens is not None:
        # What the turn's and its key's budgets leave this round (docs/spend.md).
        body["max_completion_tokens"] = max_completion_tokens
    text = json.dumps(body, separators=(",", ":"))
    schemas = tools if isinstance(tools, str) else json.dumps(tools, separators=(",", ":"))
    if schemas.strip() not in ("", "[]"):
        text = text[:-1] + ',"tools":' + schemas + "}"
    return text.encode()


def _field(obj: object, name: str) -> Any:
    """A field of a chunk's JSON object; None when it has none or is no object."""
    return obj.get(name) if isinstance(obj, dict) else None


@dataclass
class PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    done: str | None = None
    """Its whole arguments, when the stream sent them so (Responses), else the deltas'."""


class Assembler:
    """What both APIs' assemblers share: the deltas, published as they come, and the message."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        self._on_delta = on_delta
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, PartialCall] = {}
        self._usage: Usage | None = None
        self._last_index = -1

    def _say(self, kind: str, text: str) -> None:
        (self._text if kind == "text" else self._reasoning).append(text)
        self._on_delta(kind, text)

    @property
    def has_output(self) -> bool:
        """Whether the model said anything yet: text, reasoning or a tool call."""
        return bool(self._text or self._reasoning or self._calls)

    def _message(self, finish_reason: str | None, **extra: Any) -> AssistantMessage:
        calls: list[ToolCall] = []
        for position in sorted(self._calls):
            call = self._calls[position]
            if not call.name:
                bad(self._last_index, f"tool call at {position} has no name")
            arguments = "".join(call.arguments) if call.done is None else call.done
            calls.append(
                ToolCall(
                    id=call.id or f"call_{uuid.uuid4().hex[:24]}",
                    name=call.name,
                    arguments=arguments or "{}",
                )
            )
        return AssistantMessage(
            content="".join(self._text),
            reasoning="".join(self._reasoning),
            tool_calls=tuple(calls),
            finish_reason=finish_reason,
            usage=self._usage,
            **extra,
        )


class ChatAssembler(Assembler):
    """Builds the assistant message from chunk deltas, checking their shape."""

    _finish_reason: str | None = None

    def add(self, chunk: object, index: int) -> None:
        self._last_index = index
        choices = _field(chunk, "choices")
        usage = _field(chunk, "usage")
        if choices is None and usage is None:
            bad(index, "chunk has neither 'choices' nor 'usage'")
        if choices is not None and not isinstance(choices, list):
            bad(index, "'choices' is not a list")
        if usage is not None:
            self._usage = usage_of(usage, index, "prompt", "completion")
        for choice in choices or ():
            # Only one choice is ever requested; others would belong to n > 1.
            if (_field(choice, "index") or 0) == 0:
                self._add_choice(choice, index)

    def _add_choice(self, choice: object, index: int) -> None:
        finish = opt_str(choice, "finish_reason", index)
        if finish is not None:
            self._finish_reason = finish
        delta = _field(choice, "delta")
        if delta is None:
            return
        if not isinstance(delta, dict):
            bad(index, "'delta' is not an object")
        reasoning = opt_str(delta, "reasoning_content", index) or opt_str(delta, "reasoning", index)
        if reasoning:
            self._say("reasoning", reasoning)
        text = opt_str(delta, "content", index)
        if text:
            self._say("text", text)
        calls = delta.get("tool_calls")
        if calls is None:
            return
        if not isinstance(calls, list):
            bad(index, "'tool_calls' is not a list")
        for call in calls:
            self._add_call(call, index)

    def _add_call(self, call: object, index: int) -> None:
        position = _field(call, "index")
        if not isinstance(position, int):
            bad(index, "tool call delta without an integer 'index'")
        partial = self._calls.setdefault(position, PartialCall())
        call_id = opt_str(call, "id", index)
        partial.id = partial.id or call_id or ""
        function = _field(call, "function")
        if function is None:
            return
        name = opt_str(function, "name", index)
        partial.name = partial.name or name or ""
        arguments = opt_str(function, "arguments", index)
        if arguments:
            partial.arguments.append(arguments)

    def message(self) -> AssistantMessage:
        return self._message(self._finish_reason)


def bad(index: int, detail: str) -> NoReturn:
    raise MalformedStreamChunk(index, detail)


def opt_str(obj: object, name: str, index: int) -> str | None:
    value = _field(obj, name)
    if value is not None and not isinstance(value, str):
        bad(index, f"'{name}' is not a string")
    return value


def token_count(usage: object, name: str, index: int) -> int:
    """A count of a usage object (0 when absent)."""
    value = _field(usage, name) or 0
    if not isinstance(value, int):
        bad(index, f"usage '{name}' is not an integer")
    return value


def usage_of(usage: object, index: int, prompt: str, completion: str) -> Usage:
    """A usage object's counts: `<prompt>_tokens`, `<completion>_tokens` and their details
    (chat names them prompt and completion, the Responses API input and output)."""
    if not isinstance(usage, dict):
        bad(index, "'usage' is not an object")
    asked = token_count(usage, f"{prompt}_tokens", index)
    said = token_count(usage, f"{completion}_tokens", index)
    return Usage(
        prompt_tokens=asked,
        completion_tokens=said,
        total_tokens=token_count(usage, "total_tokens", index) or asked + said,
        cached_tokens=token_count(usage.get(f"{prompt}_tokens_details"), "cached_tokens", index),
        reasoning_tokens=token_count(
            usage.get(f"{completion}_tokens_details"), "reasoning_tokens", index
        ),
    )
