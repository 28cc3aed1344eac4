"""Waitpoints: a call whose tool ended its run with a wait, open in its turn's state (a
`w:` record) until a completion, its deadline or an abort settles it (docs/waitpoints.md).
Its id names its turn and call, so finding it is one read; its token is an HMAC of the id,
so a tool knows it before it returns, every run of a call gets the same, and nothing stores it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from agentq import constants as k
from agentq.config import get_settings
from agentq.errors import PayloadTooLarge, WaitpointRefused
from agentq.events.bus import SEQ_FIELD, event_body, publish_lua
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import CALL_ID, TURN_ID, InvocationRecord, ToolResult, ToolStatus
from agentq.state.base import Settled, StoreBase, TurnKeys, text
from agentq.state.lua import turn_open_lua, wake_lua

if TYPE_CHECKING:
    from agentq.state.calls import CallRecords

PREFIX = "wp_"
KEY_FIELD = f"{k.PREFIX}:waitpoints:key"
"""The fleet's waitpoint HMAC key when AGENTQ_WAITPOINT_SECRET is unset (made once, SET NX)."""
COMPLETED_STATUSES = ("ok", "error")
"""What a completion settles a call as; any other status of a waiting call closed it."""


def waitpoint_id(turn_id: str, call_id: str) -> str:
    return f"{PREFIX}{turn_id}_{call_id}"


def parse_waitpoint_id(value: str) -> tuple[str, str] | None:
    """The turn id and call id a waitpoint id names; None for anything else."""
    rest = value.removeprefix(PREFIX)
    turn_id, sep, call_id = rest[:32], rest[32:33], rest[33:]
    ok = value.startswith(PREFIX) and sep == "_" and TURN_ID.fullmatch(turn_id)
    return (turn_id, call_id) if ok and CALL_ID.fullmatch(call_id) else None


def token_for(key: bytes, wp_id: str) -> str:
    digest = hmac.new(key, wp_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def completion_of(value: Any) -> tuple[ToolStatus, str, str | None]:
    """What a completion's body means: (status, content the model reads, error)."""
    if isinstance(value, dict) and set(value) == {"error"}:
        error = value["error"] if isinstance(value["error"], str) else json.dumps(value["error"])
        return "error", error, error
    content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return "ok", content, None


def not_found(wp_id: str) -> WaitpointRefused:
    return WaitpointRefused(wp_id, 404, "no such waitpoint (or not with this token)")


class OpenArgs(NamedTuple):
    call_id: str
    record: str
    """The waitpoint's record (JSON, with `deadline_ms`)."""
    event: str
    log_opts: str
    turn_id: str
    deadline: float
    """Epoch seconds: the turn's wakeup comes by then, to settle the call `timeout`."""


# OPEN_LUA: a call's waitpoint, recorded once (a redelivered run keeps the first) unless the
# call settled or its turn is over. The turn is due by the deadline and marked woken, so a
# step that read the turn before this write steps again and sees the deadline.
OPEN_LUA = (
    bind_lua(TurnKeys, OpenArgs)
    + turn_open_lua("0", extra=(f"'{k.SETTLED}' .. call_id", f"'{k.WAITING}' .. call_id"))
    + "if more[1] or more[2] then return 0 end\n"
    + publish_lua("log_key", "channel", "event", "log_opts", "watched")
    + wake_lua(f"'{k.WAITING}' .. call_id, record, '{SEQ_FIELD}', seq", at="deadline")
    + "return 1\n"
)


class WaitpointRecords(StoreBase):
    """Opening a call's waitpoint, completing it, and the open ones of a turn."""

    _open = LuaScript(OPEN_LUA)

    @cached_property
    def waitpoint_key(self) -> bytes:
        """The HMAC key of tokens: AGENTQ_WAITPOINT_SECRET, else the fleet's (KEY_FIELD)."""
        secret = get_settings().waitpoint_secret
        if secret is not None:
            return secret.get_secret_value().encode()
        self.redis.set(KEY_FIELD, secrets.token_hex(32), nx=True)
        return text(self.redis.get(KEY_FIELD)).encode()

    def waitpoint_address(self, turn_id: str, call_id: str) -> tuple[str, str, str]:
        """(id, token, callback URL) of the call's waitpoint."""
        wp_id = waitpoint_id(turn_id, call_id)
        token = token_for(self.waitpoint_key, wp_id)
        base = get_settings().public_url.rstrip("/")
        url = f"{base}/v1/waitpoints/{wp_id}?token={token}"
        return wp_id, token, url

    def open_waitpoint(
        self, turn_id: str, call_id: str, record: dict[str, Any], event: dict[str, Any]
    ) -> bool:
        """Record the call's waitpoint and publish tool_waiting; False if not (see OPEN_LUA)."""
        args = OpenArgs(
            call_id,
            json.dumps(record, default=str),
            event_body(turn_id, "tool_waiting", event),
            self.bus.log_arg(),
            turn_id,
            record["deadline_ms"] / 1000,
        )
        opened = bool(int(self._durable(self._open, TurnKeys.of(turn_id), list(args))))
        if opened:
            self.bus.counted([("tool_waiting", event)])
        return opened

    def open_waitpoints(self, turn_id: str) -> dict[str, dict[str, Any]]:
        """The turn's waitpoints still open, by call id (their records)."""
        waiting, settled = self._calls(turn_id, k.WAITING, k.SETTLED)
        return {c: w for c, w in waiting.items() if c not in settled}

    def waitpoint_rows(self, turn_id: str) -> list[dict[str, Any]]:
        """The turn's open waitpoints, oldest first, with their age and time left."""
        now = time.time()
        rows = [
            {
                "id": w["id"],
                "call_id": call_id,
                "tool": w.get("tool"),
                "timeout_s": w["timeout_s"],
                "age_s": round(now - float(w["opened_at"]), 3),
                "left_s": round(max(0.0, w["deadline_ms"] / 1000 - now), 3),
                "data": w.get("data"),
                "tags": w.get("tags") or [],
            }
            for call_id, w in self.open_waitpoints(turn_id).items()
        ]
        return sorted(rows, key=lambda r: -r["age_s"])

    def complete_waitpoint(
        self, wp_id: str, token: str, value: Any, *, max_bytes: int
    ) -> ToolResult:
        """`Client.complete_waitpoint`, a result up to `max_bytes`; a wrong token gets the
        unknown id's 404: one answer, no oracle."""
        ids = parse_waitpoint_id(wp_id)
        expected = token_for(self.waitpoint_key, wp_id) if ids else ""
        raw_wp = None
        if ids is not None and hmac.compare_digest(expected.encode(), token.encode()):
            raw_wp = self.redis.hget(k.turn_key(ids[0]), k.WAITING + ids[1])
        if ids is None or raw_wp is None:
            raise not_found(wp_id)
        turn_id, call_id = ids
        opened = json.loads(raw_wp)
        status, content, error = completion_of(value)
        size = len(content.encode())
        if size > max_bytes:
            raise PayloadTooLarge("waitpoint result", size, max_bytes)
        now, tool = time.time(), str(opened.get("tool") or "")
        started = float(opened.get("started_at") or opened["opened_at"])
        record = InvocationRecord(
            call_id=call_id,
            tool=tool,
            status=status,
            started_at=started,
            finished_at=now,
            duration_ms=int((now - started) * 1000),
            waitpoint_id=wp_id,
            **{f: opened.get(f) for f in ("task_id", "worker", "timeout_s")},
        )
        result = ToolResult(
            call_id=call_id, tool=tool, status=status, content=content, error=error, record=record
        )
        calls = cast("CallRecords", self)  # a TurnStore: its calls' part settles the call
        # The waitpoint's record is written once: its deadline is the one the script checks.
        code = calls.settle_code(turn_id, result, deadline_ms=opened["deadline_ms"])
        if code in (Settled.WON, Settled.READY):
            return result
        if code is Settled.EXPIRED:
            raise WaitpointRefused(wp_id, 410, "timed out")
        first = calls.result(turn_id, call_id)
        if first is None:
            raise WaitpointRefused(wp_id, 410, "its turn ended")  # before the call settled
        if first.record.waitpoint_id == wp_id and first.status in COMPLETED_STATUSES:
            done = {"status": first.status, "content": first.content}
            raise WaitpointRefused(wp_id, 409, "completed already", done)
        raise WaitpointRefused(wp_id, 410, f"closed: its call settled {first.status}")
