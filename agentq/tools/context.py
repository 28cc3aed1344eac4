"""What a running tool sees of agentq: cancellation, progress, its deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(kw_only=True, eq=False)
class ToolContext:
    """Handed to a tool as its first argument (`ctx`)."""

    _CANCEL_POLL_S = 0.1

    turn_id: str
    call_id: str
    tool: str
    started_at: float
    timeout_s: float
    soft_timeout_s: float | None
    attempt: int = 1
    is_cancelled: Callable[[], bool] | None = None
    on_progress: Callable[[str, float | None, dict[str, Any]], None] | None = None
    read_secret: Callable[[], str | None] | None = None
    locate_waitpoint: Callable[[], tuple[str, str, str]] | None = None
    _cancel_checked_at: float = field(default=0.0, init=False)
    _cancelled: bool = field(default=False, init=False)

    @property
    def deadline(self) -> float | None:
        """Epoch seconds at which the worker kills this call; None when unlimited."""
        return self.started_at + self.timeout_s if self.timeout_s > 0 else None

    @property
    def time_left_s(self) -> float | None:
        d = self.deadline
        return None if d is None else max(0.0, d - time.time())

    @property
    def soft_limited(self) -> bool:
        """True once the soft limit has passed: return what you have."""
        return 0 < (self.soft_timeout_s or 0) <= time.time() - self.started_at

    @property
    def cancelled(self) -> bool:
        """True once the turn was aborted; polled cheaply, so tools may check it in loops."""
        if self._cancelled or self.is_cancelled is None:
            return self._cancelled
        now = time.monotonic()
        if now - self._cancel_checked_at >= self._CANCEL_POLL_S:
            self._cancel_checked_at = now
            self._cancelled = self.is_cancelled()
        return self._cancelled

    def progress(self, message: str = "", pct: float | None = None, **fields: Any) -> None:
        """Report progress: a `tool_progress` event for clients and a PROGRESS state in Flower."""
        if self.on_progress is not None:
            self.on_progress(message, pct, fields)

    def secret(self) -> str | None:
        """The password answered for this call, readable once; never stored anywhere else."""
        return self.read_secret() if self.read_secret is not None else None

    def waitpoint(self) -> WaitpointAddress:
        """Where the waitpoint this call opens if it returns a `Waitpoint` is completed (the same
        for every run), known beforehand so the tool can hand it to whoever completes it."""
        if self.locate_waitpoint is None:
            raise RuntimeError("this call runs outside a tool worker: it has no waitpoint")
        return WaitpointAddress(*self.locate_waitpoint())


class WaitpointAddress(NamedTuple):
    """Where a call's waitpoint is completed: `POST callback_url` with the result's JSON."""

    id: str
    token: str
    """The capability: whoever holds it may complete the waitpoint, and nobody else."""
    callback_url: str
    """`{AGENTQ_PUBLIC_URL}/v1/waitpoints/{id}?token={token}`."""


@dataclass(frozen=True)
class Waitpoint:
    """Return it to end the run with a wait: the call stays open, holding no worker, until its
    waitpoint is completed or `timeout_s` passes (docs/waitpoints.md)."""

    timeout_s: float
    data: Any = None
    idempotency_key: str | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Partial:
    """Return `Partial(value)` to mark a result incomplete (e.g. cut short by the soft limit)."""

    value: Any
    note: str = ""
