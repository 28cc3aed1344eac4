"""One attempt: sign a body (Standard Webhooks), post it to a checked address, keep only the
answer's status."""

from __future__ import annotations

import base64
import hashlib
import hmac

from agentq.config import webhook_key_bytes
from agentq.errors import WebhookRefused
from agentq.webhooks.target import check_url, resolve


def signed_headers(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> dict[str, str]:
    """The headers of one attempt: the id stays the same on every retry, the timestamp and
    so the signature (`v1,<base64 of HMAC-SHA256 over "id.timestamp.body">`) are those of
    the attempt."""
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
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    allow_http: bool,
    allow_private: bool,
) -> tuple[int | None, str | None]:
    """POST `body` once: the answer's status (None: no answer) and what went wrong. Redirects
    are not followed (a 3xx is a failed attempt): following one would post the signed body
    to a place nobody checked. The answer's body is never read."""
    # Imported here: every process that can end a turn imports this module, `agentq abort`
    # among them, and only a delivery needs an HTTP client.
    import httpx

    try:
        target = check_url(url, allow_http=allow_http, allow_private=allow_private)
        address = resolve(target, allow_private=allow_private)[0]
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
