"""What the gateway's route modules (console, jobs, replay, /mcp, ...) use of it, as a type.

`agentq.gateway.app.Gateway` mounts those routes and is one of these; the routes take it as
this type, so none of them imports the module that imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from starlette.requests import Request

    from agentq.api import Client
    from agentq.gateway.auth import Keyring, Principal
    from agentq.llm.capacity import Capacity
    from agentq.models import TurnHandle, TurnRequest
    from agentq.state.turn_state import TurnState
    from agentq.webhooks.deliveries import Deliveries


class RouteContext(Protocol):
    """The shared Client, the caller checks, the body limit and model capacity."""

    client: Client
    keyring: Keyring
    capacity: Capacity
    deliveries: Deliveries
    body_limit_bytes: int

    def require_key(self, request: Request) -> Principal | None:
        """The caller's key; with keys configured, a call without a valid one is refused."""
        ...

    def caller(self, request: Request) -> tuple[Principal | None, str | None]:
        """The key holder (if the bearer is a key) and the bearer itself (maybe a turn token)."""
        ...

    def authorize(self, turn_id: str, principal: Principal | None, token: str | None) -> TurnState:
        """The turn's state if the caller may read and steer it; anyone else: TurnNotFound."""
        ...

    def start_limited(self, req: TurnRequest, principal: Principal | None, host: str) -> TurnHandle:
        """Start a turn under the caller's start limits."""
        ...

    def limited(
        self, principal: Principal | None, host: str, start: Callable[[], TurnHandle]
    ) -> TurnHandle:
        """`start()` a turn within the caller's start rate and running-turn cap (`host`:
        the client's address, the subject of a caller without a key)."""
        ...

    def require_admin_read(self, request: Request) -> None:
        """Refuses a caller who may not read fleet-wide numbers."""
        ...

    def read_capacity(self) -> list[dict[str, Any]]:
        """The capacity snapshot of every model the gateway knows."""
        ...


__all__ = ["RouteContext"]
