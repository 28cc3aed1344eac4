"""The public surface, exact: `agentq.__all__` as a list (as httpx tests its exported
members), and the exception tree drawn in `agentq.errors`' docstring against the classes."""

from __future__ import annotations

import inspect
import re

import pytest

import agentq
from agentq import errors

PUBLIC = [
    # declaring tools
    "tool",
    "ToolContext",
    "ToolPolicy",
    "ToolSpec",
    "Partial",
    "Waitpoint",
    # declaring agents
    "Agent",
    "AgentTool",
    # running turns
    "Client",
    "AsyncClient",
    "AsyncTurn",
    "Turn",
    "TurnResult",
    "TurnUsage",
    "Settings",
    "get_settings",
    "load_settings",
    # data that crosses processes
    "AssistantMessage",
    "Event",
    "InteractionAnswer",
    "InteractionRequest",
    "InvocationRecord",
    "ToolCall",
    "ToolResult",
    "ToolResultMessage",
    "TurnHandle",
    "TurnRequest",
    # errors
    "AgentqError",
    "ConfigError",
    "PayloadTooLarge",
    "WebhookRefused",
    "ConversationNotFound",
    "ConversationBusy",
    "IdempotencyKeyReused",
    "BudgetExceeded",
    "BudgetInvalid",
    "ToolError",
    "UnknownTool",
    "ToolDefinitionError",
    "ToolArgumentsInvalid",
    "AgentError",
    "UnknownAgent",
    "AgentDefinitionError",
    "LlmError",
    "StreamIdleTimeout",
    "StreamDurationExceeded",
    "ModelHTTPError",
    "ModelBusy",
    "ModelCapacityTimeout",
    "ModelConnectionError",
    "ModelResponseFailed",
    "ModelIncomplete",
    "MalformedStreamChunk",
    "Aborted",
    "TurnError",
    "TurnFailed",
    "TurnAborted",
    "TurnTimeout",
    "TurnNotFound",
    "TokenInvalid",
    "InteractionError",
    "InteractionNotFound",
    "InteractionClosed",
    "AnswerInvalid",
    "HeadlessInteraction",
    "WaitpointRefused",
    "__version__",
]

INTERNAL_ERRORS = {"StepLost", "ModelRoundFailed", "BrokerUnavailable"}
"""Errors the machinery raises and handles itself: never a caller's to catch."""


def test_all_is_exactly_the_public_list() -> None:
    assert agentq.__all__ == PUBLIC


def test_every_public_name_resolves_and_is_what_its_module_defines() -> None:
    for name in PUBLIC:
        value = getattr(agentq, name)
        assert value is not None, name
        if name[0].isupper() and isinstance(value, type) and issubclass(value, Exception):
            assert value is getattr(errors, name), name
            assert issubclass(value, errors.AgentqError), name


def test_no_internal_error_is_public() -> None:
    assert not INTERNAL_ERRORS & set(agentq.__all__)
    for name in INTERNAL_ERRORS:
        assert hasattr(errors, name), f"{name} is gone from agentq.errors: drop it here"


def test_the_errors_start_turn_raises_are_public() -> None:
    for name in ("WebhookRefused", "ConversationNotFound", "PayloadTooLarge", "UnknownAgent"):
        assert name in agentq.__all__


_NODE = re.compile(r"^(?P<indent>(?:[│ ]   )*)[├└]── (?P<name>\w+)(?:\((?P<fields>[^)]*)\))?")


def drawn_tree() -> dict[str, tuple[str, list[str]]]:
    """The docstring's tree: each class's (drawn parent, drawn fields)."""
    lines = (errors.__doc__ or "").splitlines()
    root = next(i for i, line in enumerate(lines) if line.strip() == "AgentqError")
    tree: dict[str, tuple[str, list[str]]] = {}
    parents = ["AgentqError"]
    for line in lines[root + 1 :]:
        m = _NODE.match(line)
        if not m:
            continue
        depth = len(m["indent"]) // 4
        name = m["name"]
        fields = [f.strip() for f in (m["fields"] or "").split(",") if f.strip()]
        tree[name] = (parents[depth], fields)
        del parents[depth + 1 :]
        parents.append(name)
    return tree


def test_the_drawn_error_tree_is_the_class_tree() -> None:
    tree = drawn_tree()
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type)
        and issubclass(cls, errors.AgentqError)
        and cls.__module__ == errors.__name__
    }
    assert set(tree) == set(classes) - {"AgentqError"}, (
        f"drawn, not defined: {set(tree) - set(classes)}; "
        f"defined, not drawn: {set(classes) - set(tree) - {'AgentqError'}}"
    )
    for name, (parent, fields) in tree.items():
        cls = classes[name]
        assert cls.__bases__[0].__name__ == parent, f"{name} is drawn under {parent}"
        params = set(inspect.signature(cls.__init__).parameters)
        for f in fields:
            assert f in params or hasattr(cls, f), f"{name}({f}): no such field"


def test_fields_beside_a_turn_request_are_refused_not_dropped() -> None:
    # The gateway passes a TurnRequest; a field beside it was dropped without a word.
    from agentq.api import Client
    from agentq.models import TurnRequest

    with pytest.raises(TypeError, match="beside a TurnRequest: agent, headless"):
        Client()._start_turn(TurnRequest(prompt="x"), agent="a", headless=True)
