"""agentq: LLM agent turns as background jobs on a Celery fleet.

Every tool call is its own Celery task with soft and hard limits, a turn can be
aborted for real, the results of a round settle into one tool-result message, and
every step is published as an event over Redis.
"""

from agentq.agents import Agent, AgentTool
from agentq.api import Client
from agentq.config import Settings, get_settings, load_settings
from agentq.constants import VERSION as __version__
from agentq.errors import (
    Aborted,
    AgentDefinitionError,
    AgentError,
    AgentqError,
    ConfigError,
    HeadlessInteraction,
    InteractionClosed,
    InteractionError,
    InteractionNotFound,
    LlmError,
    MalformedStreamChunk,
    ModelBusy,
    ModelCapacityTimeout,
    ModelConnectionError,
    ModelHTTPError,
    PayloadTooLarge,
    StepLost,
    StreamDurationExceeded,
    StreamIdleTimeout,
    TokenInvalid,
    ToolArgumentsInvalid,
    ToolDefinitionError,
    ToolError,
    ToolTimeout,
    TurnError,
    TurnNotFound,
    UnknownAgent,
    UnknownTool,
)
from agentq.models import (
    AssistantMessage,
    Event,
    InteractionAnswer,
    InteractionRequest,
    InvocationRecord,
    ToolCall,
    ToolResult,
    ToolResultMessage,
    TurnHandle,
    TurnRequest,
)
from agentq.tools.context import Partial, ToolContext
from agentq.tools.policy import ToolPolicy
from agentq.tools.registry import ToolSpec, tool

__all__ = [
    # declaring tools
    "tool",
    "ToolContext",
    "ToolPolicy",
    "ToolSpec",
    "Partial",
    # declaring agents
    "Agent",
    "AgentTool",
    # running turns
    "Client",
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
    "ToolError",
    "UnknownTool",
    "ToolDefinitionError",
    "ToolArgumentsInvalid",
    "ToolTimeout",
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
    "MalformedStreamChunk",
    "Aborted",
    "TurnError",
    "TurnNotFound",
    "TokenInvalid",
    "StepLost",
    "InteractionError",
    "InteractionNotFound",
    "InteractionClosed",
    "HeadlessInteraction",
    "__version__",
]
