"""The HTTP gateway: REST and SSE for turns, the web page, /healthz and /metrics."""

from agentq.gateway.app import create_app
from agentq.gateway.server import BackgroundServer, serve

__all__ = ["BackgroundServer", "create_app", "serve"]
