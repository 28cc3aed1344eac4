"""The chat messages a client may start a turn with: the OpenAI chat format, checked up front.

A message the model server or the orchestrator would choke on mid-turn (a tool call
without a function, a tool message answering nothing, text that is not Unicode) is
refused when the turn is started, with a message naming the field, never accepted and
failed later.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentq.ids import MAX_CALL_ID_CHARS, is_call_id

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_NAME_CHARS = 64
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_FUNCTION_NAME = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_NAME_CHARS}}}")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, else None.

    JSON's ``"\\ud800"`` decodes to one; it cannot be encoded as UTF-8, so it breaks
    every later write of the text (Redis, the model request, the HTTP answer).
    """
    stack: list[tuple[Any, str]] = [(value, path)]
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


def _text(v: Any) -> Any:
    if isinstance(v, str) and _LONE_SURROGATE.search(v):
        raise ValueError("text must be valid Unicode (a lone surrogate is not)")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
CallId = Annotated[str, Field(min_length=1, max_length=MAX_CALL_ID_CHARS)]


class FunctionCall(_Strict):
    name: str
    arguments: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.fullmatch(v):
            raise ValueError(f"must be 1-{MAX_NAME_CHARS} characters of A-Z a-z 0-9 _ . : -")
        return v


class ToolCallMessage(_Strict):
    id: CallId
    type: Literal["function"]
    function: FunctionCall

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not is_call_id(v):
            raise ValueError("a call id is letters, digits and _ . : - only")
        return v


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

    Each message matches its role's shape; every tool message answers a call of the
    assistant message before it, once; every call is answered before the next message
    that is not a tool message, and by the end (a turn never runs calls a client wrote).
    """
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


def check_text(value: str | None) -> str | None:
    if value is not None and _LONE_SURROGATE.search(value):
        raise ValueError("text must be valid Unicode (a lone surrogate is not)")
    return value


__all__ = ["CHAT_ROLES", "check_messages", "check_text", "lone_surrogate_at"]
