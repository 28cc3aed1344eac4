"""The HTTP gateway: REST and SSE for turns, the web page, /healthz and /metrics."""

from agentq.gateway.app import create_app
from agentq.gateway.server import serve

__all__ = ["create_app", "serve"]
