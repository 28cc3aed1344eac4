"""The scripted model's scripts: what it answers to each round of a conversation, and
which script a request's conversation follows. Shared by the scripted server's two APIs
(`agentq.testing.openai_server` for Chat Completions, `agentq.testing.responses_answer`
for Responses).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from agentq.models import Usage

Fault = Literal[
    "silent_after_200",
    "silent_after_chunks",
    "keepalive_only",
    "http_500",
    "http_429",
    "http_400",
    "malformed",
    "disconnect",
    "incomplete",
    "failed",
]
"""`incomplete`: the answer stops at the output cap (Responses: `response.incomplete`;
chat: finish_reason `length`). `failed`: the model fails mid-answer (Responses:
`response.failed`; chat: an error event in the stream)."""

DEFAULT_KEY = "default"


class ScriptedCall(BaseModel):
    """One tool call the scripted model makes."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    """A dict is sent as JSON; a str is sent verbatim, so tests can send invalid JSON."""
    id: str | None = None

    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments)


class Round(BaseModel):
    """What the scripted model answers to one request of a conversation."""

    model_config = ConfigDict(extra="forbid")

    text: str = ""
    reasoning: str = ""
    """Streamed as `delta.reasoning_content` before the text."""
    tool_calls: list[ScriptedCall] = Field(default_factory=list)
    chunk_size: int = Field(default=8, ge=1)
    """Characters per text, reasoning or arguments delta."""
    chunk_delay_ms: int = Field(default=0, ge=0)
    """The pace of the stream: chunk i goes out i * chunk_delay_ms after the first."""
    fault: Fault | None = None
    fault_after_chunks: int = Field(default=0, ge=0)
    """For the mid-stream faults: how many data chunks go out before the fault."""
    fault_times: int = -1
    """Apply the fault on the first N attempts of this round, then answer normally; -1: always."""
    fault_message: str | None = None
    """Error text of an HTTP fault; a default names the fault."""
    retry_after_s: float | None = None
    """Sent with http_429 as `retry-after-ms` and a rounded-up `Retry-After`."""
    usage: Usage | None = None
    """The usage reported (`cached_tokens` as `prompt_tokens_details`); unset: counted at 4
    characters a token. The completion stops at the request's `max_completion_tokens`."""
    omit_usage: bool = False
    """Send no usage chunk even when the request asks for one (a server that omits it)."""
    close_connection: bool = False
    """Close the connection after this round's answer (`Connection: close`), as some proxies
    do after each stream; the server's `close_connections` does it for every answer."""
    raw_chunks: list[str] | None = None
    """Sent verbatim as the stream's `data:` lines (then `[DONE]`) instead of the above:
    arbitrary JSON, fragments or garbage, for fuzzing the stream worker."""

    def chunk_count(self) -> int:
        """Its chat data chunks (a usage chunk aside): it lasts (count - 1) *
        `chunk_delay_ms`."""
        if self.raw_chunks is not None:
            return len(self.raw_chunks)
        size = self.chunk_size
        count = len(pieces(self.reasoning, size)) + len(pieces(self.text, size)) + 1
        return count + sum(1 + len(pieces(c.arguments_json(), size)) for c in self.tool_calls)


Script = list[Round]
"""Round i answers the request that already holds i assistant messages."""

SCRIPTS = TypeAdapter(dict[str, Script])


def demo_rounds() -> Script:
    """The `agentq dev` script: two parallel tool calls, then a short summary."""
    return [
        Round(
            reasoning="The user wants a demo: call echo and sleep at the same time.",
            text="Running two tools in parallel.",
            tool_calls=[
                ScriptedCall(name="echo", arguments={"text": "hello"}),
                ScriptedCall(name="sleep", arguments={"seconds": 2}),
            ],
            chunk_size=6,
            chunk_delay_ms=20,
        ),
        Round(
            text="Both tools finished: echo returned 'hello' and sleep waited 2 seconds.",
            chunk_size=6,
            chunk_delay_ms=20,
        ),
    ]


def first_user_text(messages: Sequence[Any]) -> str:
    """The text of the first user message; content parts are joined."""
    for msg in messages:
        if isinstance(msg, Mapping) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            return ""
    return ""


def system_text(messages: Sequence[Any]) -> str:
    """The text of the first system message (an agent's instructions), or ""."""
    for msg in messages:
        if isinstance(msg, Mapping) and msg.get("role") == "system":
            content = msg.get("content")
            return content if isinstance(content, str) else ""
    return ""


def script_key(scripts: Mapping[str, Any], user: str, system: str, model: str) -> str:
    """Which script answers: the longest key the first user message starts with, else
    `system:<prefix>` of the instructions, else `model:<name>`, else "default"."""
    plain = [
        k
        for k in scripts
        if k != DEFAULT_KEY and not k.startswith(("system:", "model:")) and user.startswith(k)
    ]
    if plain:
        return max(plain, key=len)
    by_system = [
        k for k in scripts if k.startswith("system:") and system and system.startswith(k[7:])
    ]
    if by_system:
        return max(by_system, key=len)
    if f"model:{model}" in scripts:
        return f"model:{model}"
    return DEFAULT_KEY


def round_index(messages: Sequence[Any]) -> int:
    """Which round a request asks for: the assistant messages it already holds."""
    return sum(1 for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant")


@dataclass
class Plan:
    """The round a request asks for, and the fault it plays (None: none this attempt)."""

    round: Round
    index: int
    fault: Fault | None
    model: str


def usage_counts(rnd: Round, prompt_chars: int, cap: object) -> tuple[int, int, int, int]:
    """(prompt, completion, cached, reasoning) tokens of the round: scripted, else counted
    at 4 characters a token; the completion stops at the request's cap."""
    cached, reasoning = 0, len(rnd.reasoning) // 4
    if rnd.usage is not None:
        prompt, completion = rnd.usage.prompt_tokens, rnd.usage.completion_tokens
        cached, reasoning = rnd.usage.cached_tokens, rnd.usage.reasoning_tokens
    else:
        prompt = prompt_chars // 4 + 1
        chars = len(rnd.text) + len(rnd.reasoning)
        completion = (chars + sum(len(c.arguments_json()) for c in rnd.tool_calls)) // 4 + 1
    if isinstance(cap, int) and cap >= 0:
        completion = min(completion, cap)
    return prompt, completion, cached, min(reasoning, completion)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]
