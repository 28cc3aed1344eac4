"""The Responses API (`POST /v1/responses`): a round's request built from the turn's
history, and its stream of typed events read into the same assistant message a chat
stream makes. Stateless, with its reasoning items kept in history: docs/models.md."""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any, Literal, NoReturn

from agentq.errors import ModelIncomplete, ModelResponseFailed
from agentq.llm.client import (
    REASONING_ITEMS,
    Assembler,
    DeltaCallback,
    PartialCall,
    bad,
    must,
    opt,
    usage_of,
)
from agentq.models import AssistantMessage

log = logging.getLogger("agentq.llm")

ModelApi = Literal["chat", "responses"]
RESPONSES_PATH = "/responses"

UNKNOWN_EVENTS: collections.Counter[str] = collections.Counter()
"""Event types this process read and ignored, by type (new ones a provider added)."""

_REASONING_FIELDS = ("type", "id", "summary", "encrypted_content")
"""What a reasoning item keeps in history: enough to send it back, nothing else."""


def public_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as a client reads it: reasoning items keep their summaries, never
    their `encrypted_content` (the provider's sealed reasoning, for agentq to send back)."""
    return [
        {
            **m,
            REASONING_ITEMS: [
                {k: v for k, v in item.items() if k != "encrypted_content"}
                for item in m[REASONING_ITEMS]
            ],
        }
        if REASONING_ITEMS in m
        else m
        for m in messages
    ]


def _content(content: Any, assistant: bool) -> Any:
    """A chat message's content as a Responses input message's."""
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            kind = "output_text" if assistant else "input_text"
            parts.append({"type": kind, "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url") or {}
            url = image.get("url") if isinstance(image, Mapping) else image
            parts.append({"type": "input_image", "image_url": url, "detail": "auto"})
        else:
            parts.append(part)
    return parts


def input_items(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(instructions, input): the first system message is the instructions; an assistant
    message becomes its reasoning items, its text and its function calls, in that order
    (a reasoning item must come right before the item that followed it)."""
    instructions: str | None = None
    items: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role")
        if role == "system" and instructions is None and isinstance(msg.get("content"), str):
            instructions = msg["content"]
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            text = msg.get("content")
            if text or calls:
                items.extend(msg.get(REASONING_ITEMS) or ())
            if text:
                items.append({"role": "assistant", "content": _content(text, True)})
            for call in calls:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments") or "{}",
                    }
                )
        elif role == "tool":
            output = msg.get("content")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": msg.get("tool_call_id"),
                    "output": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif role in ("user", "system", "developer"):
            items.append({"role": role, "content": _content(msg.get("content"), False)})
    return instructions, items


@functools.lru_cache(maxsize=256)
def response_tools(tools_json: str) -> list[dict[str, Any]]:
    """Chat tool schemas as Responses function tools; cached by their text, which a turn
    encodes once per tool set."""
    out = []
    for tool in json.loads(tools_json or "[]"):
        function = tool.get("function") or {}
        converted = {"type": "function", "name": function.get("name")}
        if function.get("description"):
            converted["description"] = function["description"]
        converted["parameters"] = function.get("parameters") or {"type": "object"}
        converted["strict"] = bool(function.get("strict", False))
        out.append(converted)
    return out


def responses_request(
    model: str,
    messages: list[dict[str, Any]],
    tools: str,
    max_output_tokens: int | None = None,
    output_format: dict[str, Any] | None = None,
) -> bytes:
    """The streamed Responses request body, encoded."""
    instructions, items = input_items(messages)
    body: dict[str, Any] = {
        "model": model,
        "input": items,
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    if instructions is not None:
        body["instructions"] = instructions
    schemas = response_tools(tools)
    if schemas:
        body["tools"] = schemas
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    if output_format is not None:
        body["text"] = {"format": output_format}
    return json.dumps(body, separators=(",", ":")).encode()


def output_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """`text.format` for a typed final answer (an agent's `output_type`)."""
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64] or "output"
    return {"type": "json_schema", "name": safe, "schema": schema, "strict": False}


class ResponsesAssembler(Assembler):
    """Builds the assistant message from a Responses stream's events, checking their shape."""

    def __init__(self, on_delta: DeltaCallback) -> None:
        super().__init__(on_delta)
        self._reasoning_items: list[dict[str, Any]] = []
        self._texts_seen: set[int] = set()
        self._ended = False
        self.output_events = 0
        """Events that carried output: a retry after one would show it twice."""

    def add(self, event: object, index: int) -> None:
        if not isinstance(event, dict):
            bad(index, "event is not an object")
        kind = event.get("type")
        if not isinstance(kind, str):
            bad(index, "event has no string 'type'")
        match kind:
            case "response.output_text.delta":
                delta = opt(event, "delta", index, str)
                if delta:
                    self._texts_seen.add(must(event, "output_index", index, int))
                self._said("text", delta)
            case "response.reasoning_summary_text.delta" | "response.reasoning_text.delta":
                self._said("reasoning", opt(event, "delta", index, str))
            case "response.function_call_arguments.delta":
                call = self._call_of(event, index)
                delta = opt(event, "delta", index, str)
                if delta:
                    self.output_events += 1
                    call.arguments.append(delta)
            case "response.function_call_arguments.done":
                self._call_of(event, index).done = opt(event, "arguments", index, str)
            case "response.output_item.added":
                item = must(event, "item", index, dict)
                if item.get("type") == "function_call":
                    self._function_call(item, must(event, "output_index", index, int), index)
                    self.output_events += 1
            case "response.output_item.done":
                self._item_done(event, index)
            case "response.completed":
                usage = opt(must(event, "response", index, dict), "usage", index, dict)
                if usage is not None:
                    self._usage = usage_of(usage, index, "input", "output")
                self._ended = True
            case "response.incomplete":
                details = must(event, "response", index, dict).get("incomplete_details")
                reason = details.get("reason") if isinstance(details, dict) else None
                raise ModelIncomplete(str(reason or "no reason given"))
            case "response.failed":
                error = must(event, "response", index, dict).get("error")
                _failed(error if isinstance(error, dict) else {}, "response.failed")
            case "error":
                _failed(event, "an error event")
            case _ if kind not in _SAY_NOTHING:
                if UNKNOWN_EVENTS[kind] == 0:
                    log.info("ignoring Responses stream events of an unknown type: %s", kind)
                UNKNOWN_EVENTS[kind] += 1

    def _said(self, kind: str, text: str | None) -> None:
        if text:
            self.output_events += 1
            self._say(kind, text)

    def _function_call(self, item: dict[str, Any], at: int, index: int) -> PartialCall:
        call = self._calls.setdefault(at, PartialCall())
        call.id = opt(item, "call_id", index, str) or call.id
        call.name = opt(item, "name", index, str) or call.name
        return call

    def _call_of(self, event: dict[str, Any], index: int) -> PartialCall:
        call = self._calls.get(must(event, "output_index", index, int))
        if call is None:
            bad(index, f"{event['type']} for no function_call item")
        return call

    def _item_done(self, event: dict[str, Any], index: int) -> None:
        item = must(event, "item", index, dict)
        at = must(event, "output_index", index, int)
        kind = item.get("type")
        if kind == "reasoning":
            self._reasoning_items.append({k: item[k] for k in _REASONING_FIELDS if k in item})
        elif kind == "function_call":
            call = self._function_call(item, at, index)
            call.done = opt(item, "arguments", index, str) or call.done
        elif kind == "message" and at not in self._texts_seen:
            # A server that sends a message's text only whole, with no deltas.
            for part in item.get("content") or ():
                text = part.get("text") if isinstance(part, dict) else None
                self._said("text", text if isinstance(text, str) else None)

    def message(self, last: int) -> AssistantMessage:
        if not self._ended:
            bad(last, "the stream ended without response.completed")
        return self._message(
            "tool_calls" if self._calls else "stop",
            last,
            reasoning_items=tuple(self._reasoning_items),
        )


def _failed(error: dict[str, Any], default: str) -> NoReturn:
    raise ModelResponseFailed(
        str(error.get("code") or "unknown"), str(error.get("message") or default)
    )


_SAY_NOTHING = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
    }
)
"""Events that say nothing the message needs (their text came in the deltas)."""
