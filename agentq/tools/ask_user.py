"""`ask_user`: the built-in tool an `Agent(..., ask_user=True)` offers its model. A call is
never run by a worker: the turn's approval gate asks it as an `input` interaction, and the
answer (checked against the call's `answer_schema`) is the call's result."""

from __future__ import annotations

from typing import Any

from agentq.errors import ToolMisuse
from agentq.tools.registry import spec_of

NAME = "ask_user"


def ask_user(
    question: str, answer_schema: dict[str, Any] | None = None, default: Any = None
) -> str:
    """Ask the user a question and wait for the answer. Free text unless `answer_schema`
    (a JSON Schema) says otherwise: a choice is {"enum": [...]}, a small form an object
    with properties. `default`: the answer taken when nobody can be asked."""
    raise ToolMisuse(NAME, "it is answered by the user, never run by a worker")


SPEC = spec_of(
    ask_user,
    NAME,
    None,
    {"approval": "ask", "approval_kind": "input", "timeout_s": 0},
)
"""Registered nowhere: only an agent that asks for it offers it."""
