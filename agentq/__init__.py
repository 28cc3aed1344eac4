"""agentq: LLM agent turns as background jobs on a Celery fleet.

Every tool call is its own Celery task with soft and hard limits, a turn can be
aborted for real, the results of a round settle into one tool-result message, and
every step is published as an event over Redis.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

# ruff: noqa: F403, F405 - mypy reads the names of `__all__` from these star imports, and
# exports only those (tests/unit/test_startup.py checks each is there).
if _typing.TYPE_CHECKING:
    from agentq.agents import *
    from agentq.api import *
    from agentq.client.aio import *
    from agentq.config import *
    from agentq.constants import VERSION as __version__
    from agentq.errors import *
    from agentq.events import *
    from agentq.models import *
    from agentq.state.results import *
    from agentq.tools.context import *
    from agentq.tools.policy import *
    from agentq.tools.registry import *

__all__ = [
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

_SOURCES: dict[str, tuple[str, ...]] = {
    "agentq.tools.registry": ("tool", "ToolSpec"),
    "agentq.tools.context": ("ToolContext", "Partial", "Waitpoint"),
    "agentq.tools.policy": ("ToolPolicy",),
    "agentq.agents": ("Agent", "AgentTool"),
    "agentq.api": ("Client", "Turn"),
    "agentq.client.aio": ("AsyncClient", "AsyncTurn"),
    "agentq.state.results": ("TurnResult", "TurnUsage"),
    "agentq.config": ("Settings", "get_settings", "load_settings"),
    "agentq.models": (
        "AssistantMessage",
        "InteractionAnswer",
        "InteractionRequest",
        "InvocationRecord",
        "ToolCall",
        "ToolResult",
        "ToolResultMessage",
        "TurnHandle",
        "TurnRequest",
    ),
    "agentq.events": ("Event",),
    "agentq.constants": ("__version__",),
}
"""Where each public name lives; any other is in `agentq.errors` (test_startup.py checks)."""
_ALIASES = {"__version__": "VERSION"}


def __getattr__(name: str) -> _typing.Any:
    """PEP 562: import a public name on first use, so `agentq --version` skips Celery."""
    if name not in __all__:
        raise AttributeError(f"module 'agentq' has no attribute {name!r}")
    module = next((m for m, names in _SOURCES.items() if name in names), "agentq.errors")
    value = getattr(_importlib.import_module(module), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
