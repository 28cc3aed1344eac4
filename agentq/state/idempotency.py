"""Idempotent starts: the same Idempotency-Key from the same caller starts one turn.

The first request claims the key's record (SET NX, pending); the others wait for it and
answer with its turn. A failed start drops the record, so a retry is tried again. The token
is sealed with the key itself (only its sha256 names the record): Redis learns neither.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import redis

from agentq import constants as k
from agentq.errors import IdempotencyKeyReused
from agentq.models import TurnHandle

MAX_KEY_BYTES = 255
WAIT_FOR_FIRST_S = 10.0
"""How long a repeat waits for the first request with its key to finish starting."""
_POLL_S = 0.01


def check_key(key: str) -> str:
    """The key as given, or ValueError saying what is wrong with it."""
    size = len(key.encode())
    if size == 0:
        raise ValueError("Idempotency-Key: empty; send 1 to 255 bytes, or no header")
    if size > MAX_KEY_BYTES:
        raise ValueError(f"Idempotency-Key: {size} bytes, more than {MAX_KEY_BYTES}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ValueError("Idempotency-Key: control characters are not allowed")
    return key


def fingerprint(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _sealed(key: str, handle: dict[str, Any], seal: bool) -> dict[str, Any]:
    """The handle with its tokens sealed (`seal`) or opened again."""
    out = dict(handle)
    for field in ("token", "conversation_token"):
        if out.get(field):
            raw = out[field].encode() if seal else base64.b64decode(out[field])
            pad = hashlib.shake_256(b"agentq.idempotency\0" + key.encode()).digest(len(raw))
            done = bytes(a ^ b for a, b in zip(raw, pad, strict=True))
            out[field] = base64.b64encode(done).decode() if seal else done.decode()
    return out


def start_once(
    client: redis.Redis,
    caller: str,
    key: str,
    body: str,
    turn_id: str,
    start: Callable[[], TurnHandle],
) -> TurnHandle:
    """`start()` the first time this caller sends `key` (within IDEMPOTENCY_TTL_S), else
    the handle the first time returned; IdempotencyKeyReused if the body differs."""
    record_key = k.idempotency_key(caller, key)
    claim = json.dumps({"body": body, "turn_id": turn_id, "state": "pending"})
    deadline = time.monotonic() + WAIT_FOR_FIRST_S
    while not client.set(record_key, claim, nx=True, ex=k.IDEMPOTENCY_TTL_S):
        raw = client.get(record_key)
        if raw is None:
            continue  # the first one failed and let go: this one tries
        record = json.loads(raw)
        if record["body"] != body:
            raise IdempotencyKeyReused()
        if record["state"] == "done":
            return TurnHandle.model_validate(_sealed(key, record["handle"], False))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the first request with this Idempotency-Key is still starting its turn "
                f"after {WAIT_FOR_FIRST_S:g} s; try again"
            )
        time.sleep(_POLL_S)
    try:
        handle = start()
    except BaseException:
        client.delete(record_key)
        raise
    stored = _sealed(key, handle.model_dump(exclude_none=True), True)
    done = {"body": body, "turn_id": handle.turn_id, "state": "done", "handle": stored}
    client.set(record_key, json.dumps(done), xx=True, keepttl=True)
    return handle
