"""The Chat Completions wire format: the request body, a stream's chunks assembled into
one assistant message, and the SDK's errors as agentq's (`agentq.llm.aclient` streams)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

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

_T = TypeVar("_T")


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
REASONING_ITEMS = "reasoning_items"
"""The key of an assistant message in history that holds its Responses reasoning items."""


def without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as Chat Completions takes it: the Responses reasoning items dropped."""
    return [
        {k: v for k, v in m.items() if k != REASONING_ITEMS} if REASONING_ITEMS in m else m
        for m in messages
    ]


def chat_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: str,
    max_completion_tokens: int | None = None,
) -> bytes:
    """The streamed chat-completions request body, encoded: `chat.completions.create`'s
    per-request transform cost a busy stream worker a fifth of its CPU, so the schemas are
    spliced in as the text the turn encoded once per tool set."""
    body: dict[str, Any] = {
        "model": model,
        "messages": without_reasoning(messages),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_completion_tokens is not None:
        # What the turn's and its key's budgets leave this round (docs/spend.md).
        body["max_completion_tokens"] = max_completion_tokens
    text = json.dumps(body, separators=(",", ":"))
    if tools.strip() not in ("", "[]"):
        text = text[:-1] + ',"tools":' + tools + "}"
    return text.encode()


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

    def _say(self, kind: str, text: str) -> None:
        (self._text if kind == "text" else self._reasoning).append(text)
        self._on_delta(kind, text)

    @property
    def has_output(self) -> bool:
        """Whether the model said anything yet: text, reasoning or a tool call."""
        return bool(self._text or self._reasoning or self._calls)

    def _message(self, finish_reason: str | None, last: int, **extra: Any) -> AssistantMessage:
        """The message, or MalformedStreamChunk at `last`, the index of the stream's last chunk."""
        calls: list[ToolCall] = []
        for position, call in sorted(self._calls.items()):
            if not call.name:
                bad(last, f"tool call at {position} has no name")
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
        choices = opt(chunk, "choices", index, list)
        usage = opt(chunk, "usage", index, dict)
        if choices is None and usage is None:
            bad(index, "chunk has neither 'choices' nor 'usage'")
        if usage is not None:
            self._usage = usage_of(usage, index, "prompt", "completion")
        for choice in choices or ():
            # Only one choice is ever requested; others would belong to n > 1.
            if (opt(choice, "index", index, object) or 0) == 0:
                self._add_choice(choice, index)

    def _add_choice(self, choice: object, index: int) -> None:
        finish = opt(choice, "finish_reason", index, str)
        if finish is not None:
            self._finish_reason = finish
        delta = opt(choice, "delta", index, dict)
        if delta is None:
            return
        reasoning = opt(delta, "reasoning_content", index, str)
        reasoning = reasoning or opt(delta, "reasoning", index, str)
        if reasoning:
            self._say("reasoning", reasoning)
        text = opt(delta, "content", index, str)
        if text:
            self._say("text", text)
        if delta.get("tool_calls") is not None:
            for call in must(delta, "tool_calls", index, list):
                self._add_call(call, index)

    def _add_call(self, call: object, index: int) -> None:
        partial = self._calls.setdefault(must(call, "index", index, int), PartialCall())
        call_id = opt(call, "id", index, str)
        partial.id = partial.id or call_id or ""
        function = opt(call, "function", index, object)
        name = opt(function, "name", index, str)
        partial.name = partial.name or name or ""
        arguments = opt(function, "arguments", index, str)
        if arguments:
            partial.arguments.append(arguments)

    def message(self, last: int) -> AssistantMessage:
        return self._message(self._finish_reason, last)


def bad(index: int, detail: str) -> NoReturn:
    raise MalformedStreamChunk(index, detail)


_KINDS = {str: "a string", int: "an integer", dict: "an object", list: "a list"}


def opt(obj: object, name: str, index: int, kind: type[_T]) -> _T | None:
    """A field of a chunk's JSON object, of type `kind` (`object`: any); None when absent."""
    value = obj.get(name) if isinstance(obj, dict) else None
    if value is not None and not isinstance(value, kind):
        bad(index, f"'{name}' is not {_KINDS[kind]}")
    return value


def must(obj: object, name: str, index: int, kind: type[_T]) -> _T:
    """A field the chunk's object must have, of type `kind`."""
    value = opt(obj, name, index, kind)
    if value is None:
        bad(index, f"'{name}' is not {_KINDS[kind]}")
    return value


def usage_of(usage: dict[str, Any], index: int, prompt: str, completion: str) -> Usage:
    """A usage object's counts: `<prompt>_tokens`, `<completion>_tokens` and their details
    (chat names them prompt and completion, the Responses API input and output)."""

    def count(of: object, name: str) -> int:
        value = opt(of, name, index, object) or 0
        if not isinstance(value, int):
            bad(index, f"usage '{name}' is not an integer")
        return value

    asked = count(usage, f"{prompt}_tokens")
    said = count(usage, f"{completion}_tokens")
    return Usage(
        prompt_tokens=asked,
        completion_tokens=said,
        total_tokens=count(usage, "total_tokens") or asked + said,
        cached_tokens=count(usage.get(f"{prompt}_tokens_details"), "cached_tokens"),
        reasoning_tokens=count(usage.get(f"{completion}_tokens_details"), "reasoning_tokens"),
    )
