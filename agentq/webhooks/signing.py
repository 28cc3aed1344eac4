"""Standard Webhooks signatures: `v1,<base64 of HMAC-SHA256 over "id.timestamp.body">`."""

from __future__ import annotations

import base64
import hashlib
import hmac

from agentq.config import webhook_key_bytes


def sign(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> str:
    """The `webhook-signature` header value of one attempt."""
    signed = f"{msg_id}.{timestamp_s}.".encode() + body
    mac = hmac.new(webhook_key_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> dict[str, str]:
    """The headers of one attempt: the id stays the same on every retry, the timestamp and
    so the signature are those of the attempt."""
    return {
        "content-type": "application/json",
        "user-agent": "agentq-webhooks",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": sign(secret, msg_id, timestamp_s, body),
    }
