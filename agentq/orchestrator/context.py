"""What one running turn carries: its id, its store, its inbox, its abort check."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from agentq.config import Settings
from agentq.errors import Aborted
from agentq.store import TurnStore


@dataclass
class TurnContext:
    turn_id: str
    store: TurnStore
    app: Celery
    settings: Settings
    headless: bool = False
    lease_lost: bool = False
    deferred: list[dict[str, Any]] = field(default_factory=list)
    """Inbox messages read while waiting for something else, handed out on the next wait."""

    def check_abort(self) -> None:
        reason = self.store.cancel_reason(self.turn_id)
        if reason is not None:
            raise Aborted(self.turn_id, reason)

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """Next inbox message within `timeout_s`, or None; raises Aborted on an abort."""
        if self.lease_lost:
            raise Aborted(self.turn_id, "lease lost")
        if self.deferred:
            return self.deferred.pop(0)
        msg = self.store.pop(self.turn_id, timeout_s)
        if msg is not None and msg.get("kind") == "abort":
            raise Aborted(self.turn_id, str(msg.get("reason", "user")))
        return msg

    def wait_until(self, deadline: float) -> dict[str, Any] | None:
        return self.wait(max(0.0, deadline - time.time()))

    def publish(self, type_: str, **fields: Any) -> int:
        return self.store.bus.publish(self.turn_id, type_, **fields)
