"""The event bus: every step of a turn on Redis pub/sub, with a replayable log.

The typed events (`from agentq.events import ToolFinished, TurnFinished, ...`) live in
`agentq.events.types`."""

from agentq.events.types import *  # noqa: F403
from agentq.events.types import __all__ as __all__
