"""The Chat Completions wire format: the request body, a stream's chunks assembled into
one assistant message, and the SDK's errors as agentq's (`agentq.llm.aclient` streams)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import openai
import pydantic

from agentq.errors import (
    MalformedStreamChunk,
    ModelBusy,
    ModelConnectionError,
    ModelHTTPError,
)
from agentq.llm.headers import BUSY_STATUSES, parse_retry_after, rate_headers
from agentq.llm.retry import retryable_status
from agentq.models import AssistantMessage, ToolCall, Usage

DeltaCallback = Callable[[str, str], None]
"""(kind, text): kind is "text" or "reasoning"."""

Tools = list[dict[str, Any]] | str
"""Tool schemas: a list, or the JSON array text of one (the stream worker's form)."""


def api_error_to_llm(exc: openai.APIError) -> ModelHTTPError:
    """The agentq error for an SDK error, with the server's own message."""
    if isinstance(exc, openai.APIStatusError):
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
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
        return ModelConnectionError(detail)
    # An error event inside a 200 stream.
    return ModelHTTPError(200, f"error in the stream: {exc.message}", False)


CHAT_COMPLETIONS_PATH = "/chat/completions"


def chat_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: Tools,
    max_completion_tokens: int | None = None,
) -> bytes:
    """The streamed chat-completions request body, encoded.

    Sent through the SDK's own `post` (its auth, errors and transport) as its `content`,
    which it sends as it is: the turn's history and the tool schemas are JSON already, and the
    per-request transform of `chat.completions.create` cost a busy stream worker a fifth
    of its CPU. A stream worker gets the schemas as the text the turn encoded once per
    tool set and splices them in unparsed. Chunks come back as plain dicts for the same
    reason (the SDK's model construction cost as much).
    """
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
    """A chunk's field, whether the chunk is a dict (raw JSON) or an SDK object."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


@dataclass
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ChatAssembler:
    """Builds the assistant message from chunk deltas, checking their shape."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        self._on_delta = on_delta
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, _PartialCall] = {}
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._last_index = -1

    def add(self, chunk: object, index: int) -> None:
        self._last_index = index
        choices = _field(chunk, "choices")
        usage = _field(chunk, "usage")
        if choices is None and usage is None:
            _bad(index, "chunk has neither 'choices' nor 'usage'")
        if choices is not None and not isinstance(choices, list):
            _bad(index, "'choices' is not a list")
        if usage is not None:
            self._usage = _usage(usage, index)
        for choice in choices or ():
            # Only one choice is ever requested; others would belong to n > 1.
            if (_field(choice, "index") or 0) == 0:
                self._add_choice(choice, index)

    def _add_choice(self, choice: object, index: int) -> None:
        finish = _opt_str(choice, "finish_reason", index)
        if finish is not None:
            self._finish_reason = finish
        delta = _field(choice, "delta")
        if delta is None:
            return
        if not isinstance(delta, (dict, pydantic.BaseModel)):
            _bad(index, "'delta' is not an object")
        reasoning = _opt_str(delta, "reasoning_content", index) or _opt_str(
            delta, "reasoning", index
        )
        if reasoning:
            self._reasoning.append(reasoning)
            self._on_delta("reasoning", reasoning)
        text = _opt_str(delta, "content", index)
        if text:
            self._text.append(text)
            self._on_delta("text", text)
        calls = _field(delta, "tool_calls")
        if calls is None:
            return
        if not isinstance(calls, list):
            _bad(index, "'tool_calls' is not a list")
        for call in calls:
            self._add_call(call, index)

    def _add_call(self, call: object, index: int) -> None:
        position = _field(call, "index")
        if not isinstance(position, int):
            _bad(index, "tool call delta without an integer 'index'")
        partial = self._calls.setdefault(position, _PartialCall())
        call_id = _opt_str(call, "id", index)
        if call_id and not partial.id:
            partial.id = call_id
        function = _field(call, "function")
        if function is None:
            return
        name = _opt_str(function, "name", index)
        if name and not partial.name:
            partial.name = name
        arguments = _opt_str(function, "arguments", index)
        if arguments:
            partial.arguments.append(arguments)

    @property
    def has_output(self) -> bool:
        """Whether the model said anything yet: text, reasoning or a tool call."""
        return bool(self._text or self._reasoning or self._calls)

    def message(self) -> AssistantMessage:
        calls: list[ToolCall] = []
        for position in sorted(self._calls):
            partial = self._calls[position]
            if not partial.name:
                _bad(self._last_index, f"tool call at index {position} has no function name")
            calls.append(
                ToolCall(
                    id=partial.id or f"call_{uuid.uuid4().hex[:24]}",
                    name=partial.name,
                    arguments="".join(partial.arguments) or "{}",
                )
            )
        return AssistantMessage(
            content="".join(self._text),
            reasoning="".join(self._reasoning),
            tool_calls=tuple(calls),
            finish_reason=self._finish_reason,
            usage=self._usage,
        )


def _bad(index: int, detail: str) -> NoReturn:
    raise MalformedStreamChunk(index, detail)


def _opt_str(obj: object, name: str, index: int) -> str | None:
    value = _field(obj, name)
    if value is not None and not isinstance(value, str):
        _bad(index, f"'{name}' is not a string")
    return value


def _usage(usage: object, index: int) -> Usage:
    counts: dict[str, int] = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = _field(usage, name) or 0
        if not isinstance(value, int):
            _bad(index, f"usage '{name}' is not an integer")
        counts[name] = value
    details = _field(usage, "prompt_tokens_details")
    cached = (_field(details, "cached_tokens") if details is not None else None) or 0
    if not isinstance(cached, int):
        _bad(index, "usage 'prompt_tokens_details.cached_tokens' is not an integer")
    output = _field(usage, "completion_tokens_details")
    reasoning = (_field(output, "reasoning_tokens") if output is not None else None) or 0
    if not isinstance(reasoning, int):
        _bad(index, "usage 'completion_tokens_details.reasoning_tokens' is not an integer")
    return Usage(
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        total_tokens=counts["total_tokens"],
        cached_tokens=cached,
        reasoning_tokens=reasoning,
    )
