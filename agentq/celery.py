"""`celery -A agentq ...`: Celery looks for the app here (`agentq.celery:app`).

`celery -A agentq worker -Q agentq.tools` is a tool worker as safe as `agentq worker
tools`: its role, heartbeat and pool rule follow from the queues it consumes.
"""

from __future__ import annotations

from agentq.worker import app

__all__ = ["app"]
