"""What the gateway's route modules (console, jobs, replay, /mcp, ...) use of it, as a type.

`agentq.gateway.app.Gateway` mounts those routes and is one of these; the routes take it as
this type, so none of them imports the module that imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from starlette.requests import Request

    from agentq.api import Client
    from agentq.gateway.auth import Keyring, Principal
    from agentq.llm.capacity import Capacity
    from agentq.models import TurnHandle, TurnRequest
    from agentq.state.turn_state import TurnState
    from agentq.webhooks.deliveries import Deliveries

NO_STORE = {"Cache-Control": "no-store"}
"""The header of an answer that holds a caller's own data."""


class RouteContext(Protocol):
    """The shared Client, the caller checks, the body limit and model capacity."""

    client: Client
    keyring: Keyring
    capacity: Capacity
    deliveries: Deliveries
    body_limit_bytes: int

    # Documented where the gateway defines them (agentq.gateway.app.Gateway).
    def require_key(self, request: Request) -> Principal | None: ...

    def authorize(
        self, turn_id: str, principal: Principal | None, token: str | None
    ) -> TurnState: ...

    def start_limited(
        self, req: TurnRequest, principal: Principal | None, host: str
    ) -> TurnHandle: ...

    def limited(
        self, principal: Principal | None, host: str, start: Callable[[], TurnHandle]
    ) -> TurnHandle: ...

    def require_operator(self, request: Request) -> Principal | None: ...

    async def steerer(
        self, request: Request, turn_id: str
    ) -> tuple[Principal | None, str | None, bool]: ...

    def require_admin_read(self, request: Request) -> None: ...
