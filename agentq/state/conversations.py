"""Conversations: a history that successive turns continue, bound to whoever created it.

The first turn that names a `conversation_id` claims it: the conversation is bound to the
sha256 of its owner's key name, or, without a key, to the sha256 of a conversation token
returned to the creator once. Continuing it needs the same owner (an admin key, or an
operator holding Redis credentials, may continue any); anyone else gets the same answer
as for an unknown conversation. A conversation whose binding has expired (the retention
TTL of turns) is gone: the next turn naming it starts it afresh, bound to that caller.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Any

import redis

from agentq import constants as k
from agentq.errors import ConversationNotFound, PayloadTooLarge


def _binding(kind: str, value: str) -> str:
    return f"{kind}:{hashlib.sha256(value.encode()).hexdigest()}"


@dataclass(frozen=True)
class Opened:
    """The stored history to continue, and the token of a conversation created just now."""

    prior: list[dict[str, Any]]
    token: str | None = None


def open_conversation(
    client: redis.Redis,
    conversation_id: str,
    *,
    new_bytes: int,
    max_bytes: int,
    ttl_s: int,
    owner: str | None = None,
    admin: bool = False,
    operator: bool = False,
    token: str | None = None,
) -> Opened:
    """Claim a new conversation or check the caller may continue this one; enforce its cap."""
    if new_bytes > max_bytes:
        raise PayloadTooLarge(f"conversation {conversation_id}", new_bytes, max_bytes)
    owner_key = k.conversation_owner_key(conversation_id)
    history_key = k.conversation_key(conversation_id)
    new_token = None if owner else secrets.token_urlsafe(32)
    claim = _binding("owner", owner) if owner else _binding("secret", str(new_token))
    if client.set(owner_key, claim, nx=True, ex=ttl_s):
        # Whatever outlived an expired binding is not this caller's to read.
        client.delete(history_key)
        return Opened([], new_token)
    raw = client.get(owner_key)
    bound = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    allowed = operator or admin
    if owner:
        allowed |= hmac.compare_digest(bound, _binding("owner", owner))
    if token:
        allowed |= hmac.compare_digest(bound, _binding("secret", token))
    if not allowed:
        raise ConversationNotFound(conversation_id)
    stored = client.lrange(history_key, 0, -1)
    size = sum(len(m) for m in stored) + new_bytes
    if size > max_bytes:
        raise PayloadTooLarge(
            f"conversation {conversation_id} (its history plus this request's messages)",
            size,
            max_bytes,
        )
    pipe = client.pipeline(transaction=False)
    pipe.expire(owner_key, ttl_s)
    pipe.expire(history_key, ttl_s)
    pipe.execute()
    return Opened([json.loads(m) for m in stored])


__all__ = ["Opened", "open_conversation"]
