"""Where agentq may post a webhook, and one signed attempt there (Standard Webhooks). Each
attempt connects to one of the very addresses it checked (the name as Host and SNI): a name
cannot resolve to a public address for the check and a private one for the post."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from agentq.config import Settings, webhook_key_bytes
from agentq.errors import WebhookRefused

MAX_URL_CHARS = 2048


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str
    """Path and query, as sent."""

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"

    def url_for(self, address: str) -> str:
        """The URL with `address` in place of the name: what the transport connects to."""
        netloc = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{netloc}:{self.port}{self.path}"


def address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why a webhook may not go to `address` (without AGENTQ_WEBHOOK_ALLOW_PRIVATE), or None."""
    address = getattr(address, "ipv4_mapped", None) or address
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return "not a unicast address"
    if not address.is_global:
        return "not a public address"
    return None


def check_url(url: str, *, allow_http: bool, allow_private: bool) -> Target:
    if len(url) > MAX_URL_CHARS:
        raise WebhookRefused(url[:64] + "...", f"longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(url, f"not a URL ({exc})") from None
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        hint = "" if allow_http else " (http:// needs AGENTQ_WEBHOOK_ALLOW_HTTP=true)"
        raise WebhookRefused(url, f"the scheme must be {' or '.join(schemes)}{hint}")
    if parts.username is not None or parts.password is not None:
        raise WebhookRefused(url, "credentials in the URL are not sent; put a token in the path")
    if parts.fragment:
        raise WebhookRefused(url, "a fragment (#...) is never sent")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise WebhookRefused(url, "no host")
    if not allow_private:
        if host == "localhost" or host.endswith(".localhost"):
            raise WebhookRefused(url, f"{host} is a loopback name{_PRIVATE_HINT}")
        try:
            problem = address_problem(ipaddress.ip_address(host))
        except ValueError:  # a name: its addresses are checked at each attempt
            problem = None
        if problem:
            raise WebhookRefused(url, f"{host} is {problem}{_PRIVATE_HINT}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(
        url=url,
        scheme=parts.scheme,
        host=host,
        port=port or (443 if parts.scheme == "https" else 80),
        path=path,
    )


_PRIVATE_HINT = " (allowed with AGENTQ_WEBHOOK_ALLOW_PRIVATE=true)"


def resolve(target: Target, *, allow_private: bool) -> list[str]:
    """The addresses of the target's host, every one of them allowed, else WebhookRefused."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise WebhookRefused(target.url, f"{target.host} does not resolve ({exc})") from None
    # Without a scope id (`fe80::1%eth0`), each once, in the resolver's order.
    addresses = list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))
    if not allow_private:
        for address in addresses:
            problem = address_problem(ipaddress.ip_address(address))
            if problem:
                raise WebhookRefused(
                    target.url, f"{target.host} resolves to {address}, {problem}{_PRIVATE_HINT}"
                )
    if not addresses:
        raise WebhookRefused(target.url, f"{target.host} has no address")
    return addresses


def check_for_turn(url: str, settings: Settings) -> Target:
    """A webhook URL, checked as its turn starts and at each attempt: deliverable, signable here."""
    target = check_url(
        url, allow_http=settings.webhook_allow_http, allow_private=settings.webhook_allow_private
    )
    if settings.webhook_secret is None:
        raise WebhookRefused(url, "AGENTQ_WEBHOOK_SECRET is not set, so nothing can be signed")
    return target


def signed_headers(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> dict[str, str]:
    """One attempt's headers: the same id on every retry, the attempt's timestamp and signature."""
    signed = f"{msg_id}.{timestamp_s}.".encode() + body
    mac = hmac.new(webhook_key_bytes(secret), signed, hashlib.sha256).digest()
    return {
        "content-type": "application/json",
        "user-agent": "agentq-webhooks",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


def post(
    url: str, body: bytes, headers: dict[str, str], settings: Settings
) -> tuple[int | None, str | None]:
    """POST `body` once: the answer's status (None: no answer) and what went wrong. A 3xx is
    not followed: it would post the signed body to a place nobody checked."""
    # Imported here: every process that can end a turn imports this module, `agentq abort`
    # among them, and only a delivery needs an HTTP client.
    import httpx

    timeout_s = settings.webhook_timeout_s
    try:
        target = check_for_turn(url, settings)
        address = resolve(target, allow_private=settings.webhook_allow_private)[0]
    except WebhookRefused as exc:
        return None, f"refused: {exc.reason}"
    try:
        # trust_env=False: no proxy from the environment, which would resolve the name again.
        with (
            httpx.Client(
                timeout=httpx.Timeout(timeout_s), follow_redirects=False, trust_env=False
            ) as client,
            client.stream(
                "POST",
                target.url_for(address),
                content=body,
                headers={**headers, "host": target.host_header},
                extensions={"sni_hostname": target.host},
            ) as response,
        ):
            code = response.status_code
    except httpx.TimeoutException:
        return None, f"timed out after {timeout_s:g}s"
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"[:300]
    if 200 <= code < 300:
        return code, None
    return code, f"HTTP {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
