"""Celery's `-A agentq` finds the app here; its worker's role, heartbeat and pool rule follow
from its queues, as with `agentq worker`."""

from __future__ import annotations

from agentq.worker import app

__all__ = ["app"]
