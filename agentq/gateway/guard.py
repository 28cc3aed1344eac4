"""Cross-site protection: a page the user visits must not drive a gateway it can reach (on
their own machine, above all, maybe without keys). Browsers attach `Origin` to every POST,
and a `no-cors` page sends only text, form or multipart bodies; `Host` must name this
gateway, so a DNS-rebinding page cannot read a loopback one (bound to 0.0.0.0: keys guard it)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from agentq.errors import AccessError, Forbidden, UnsupportedMediaType
from agentq.gateway.auth import is_loopback
from agentq.gateway.errors import error_response

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def host_name(host_header: str) -> str:
    """`example.com:8000` -> `example.com`; `[::1]:8000` -> `::1`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class RequestGuard:
    """Refuses cross-site mutating requests, non-JSON bodies and foreign Host headers."""

    def __init__(self, app: ASGIApp, *, bind_host: str, cors_origins: Iterable[str]) -> None:
        self.app = app
        self.cors_origins = frozenset(cors_origins)
        self.any_host = bind_host.strip().lower() in WILDCARD_HOSTS
        self.hosts = {host_name(bind_host)} | {
            host_name(o.split("://", 1)[1]) for o in self.cors_origins
        }

    def refusal(self, scope: Scope) -> AccessError | None:
        headers = Headers(scope=scope)
        if scope["path"] == "/healthz":
            return None
        host = headers.get("host", "")
        name = host_name(host)
        if not (self.any_host or is_loopback(name) or name in self.hosts):
            return Forbidden(f"Host {host!r} does not name this gateway")
        if scope["method"] not in MUTATING:
            return None
        origin = headers.get("origin")
        scheme = scope.get("scheme", "http")
        if origin is not None:
            origin = origin.strip().lower()
            if origin != f"{scheme}://{host.lower()}" and origin not in self.cors_origins:
                return Forbidden(f"cross-origin request from {origin} refused")
        elif headers.get("sec-fetch-site") == "cross-site":
            return Forbidden("cross-site request refused")
        content_type = headers.get("content-type", "")
        declared = headers.get("content-length")
        has_body = "transfer-encoding" in headers or (declared not in (None, "0"))
        if (content_type or has_body) and not is_json(content_type):
            return UnsupportedMediaType(content_type)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
            return
        answer = error_response(refused.status_code, type(refused).__name__, refused.message)
        await answer(scope, receive, send)
