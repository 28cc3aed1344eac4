"""The policy a tool runs under (unset fields take their defaults where the tool is loaded;
"no limit" is `0` everywhere), and what it decides over time: limits, deadline, budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentq.constants import QUEUE_IO, QUEUE_TOOLS
from agentq.models import InteractionKind

Concurrency = Literal["parallel", "exclusive"]
Approval = Literal["auto", "ask", "deny"]


class ToolPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float | None = Field(None, ge=0)
    """Hard limit: the call is killed (sync) or cancelled (async); 0 means no limit;
    unset takes AGENTQ_TOOL_TIMEOUT_S."""
    soft_timeout_s: float | None = Field(None, gt=0)
    """Soft limit raised inside the tool; default 0.9 x timeout_s."""
    budget_s: float | None = Field(None, ge=0)
    """Advisory: only measured, sets `overran`; unset takes AGENTQ_TOOL_BUDGET_S."""
    max_timeout_s: float | None = Field(None, ge=0)
    """Ceiling for a per-call `_meta.timeout_s` hint; default timeout_s."""
    concurrency: Concurrency = "parallel"
    approval: Approval = "auto"
    approval_kind: InteractionKind = "approval"
    approval_timeout_s: float | None = Field(None, gt=0)
    """Finite wait for an answer; default per kind from the settings."""
    approval_default: Literal["approve", "deny"] | None = None
    """What a headless turn does without asking; unset fails the headless turn."""
    queue: str | None = None
    """Unset: `agentq.tools` for sync tools, `agentq.io` for async and threaded ones."""
    thread: bool = False
    """A sync tool runs in a thread of the I/O worker instead of a prefork process; its
    hard limit then settles `timeout` and abandons the thread (it cannot be killed)."""
    idempotent: bool = False
    """A call lost with its worker process is run again instead of settling as lost."""
    max_retries: int = Field(1, ge=0, le=10)

    @model_validator(mode="after")
    def _coherent(self) -> ToolPolicy:
        if self.timeout_s and (self.soft_timeout_s or 0) >= self.timeout_s:
            raise ValueError(
                f"soft_timeout_s ({self.soft_timeout_s:g}) must be below "
                f"timeout_s ({self.timeout_s:g})"
            )
        if self.timeout_s and 0 < (self.max_timeout_s or 0) < self.timeout_s:
            raise ValueError("max_timeout_s must not be below timeout_s")
        asks_code = self.approval == "ask" and self.approval_kind == "device_code"
        if asks_code and self.approval_timeout_s is None:
            raise ValueError("a device_code interaction must declare a finite approval_timeout_s")
        return self

    def resolved(self, *, timeout_s: float, budget_s: float, on_io: bool) -> ResolvedPolicy:
        """This policy with every unset default filled in: what workers and turns read."""
        timeout = self.timeout_s if self.timeout_s is not None else timeout_s
        soft = self.soft_timeout_s
        if soft is not None and timeout and soft >= timeout:
            # A setting below the declared soft limit leaves the default 0.9 x timeout.
            soft = None
        return ResolvedPolicy(
            **{
                **self.model_dump(),
                "timeout_s": timeout,
                "soft_timeout_s": soft,
                "budget_s": self.budget_s if self.budget_s is not None else budget_s,
                "queue": self.queue or (QUEUE_IO if on_io else QUEUE_TOOLS),
            }
        )


class ResolvedPolicy(ToolPolicy):
    """A policy with every default filled in (`ToolSpec.policy`)."""

    timeout_s: float = Field(ge=0)
    budget_s: float = Field(ge=0)
    queue: str


SOFT_FRACTION = 0.9
META_KEY = "_meta"


@dataclass(frozen=True)
class Limits:
    """The limits one call runs under; 0 means unlimited."""

    timeout_s: float
    soft_timeout_s: float
    budget_s: float


def effective_limits(policy: ToolPolicy, hint_s: float | None) -> Limits:
    """Apply a per-call hint to a tool's policy (unset limits: none), clamped to its ceiling."""
    timeout_s, budget_s = policy.timeout_s or 0.0, policy.budget_s or 0.0
    ceiling = timeout_s if policy.max_timeout_s is None else policy.max_timeout_s
    effective = timeout_s
    if hint_s is not None and hint_s > 0:
        effective = hint_s if ceiling <= 0 else min(hint_s, ceiling)
    if effective <= 0:
        return Limits(timeout_s=0.0, soft_timeout_s=0.0, budget_s=budget_s)
    soft = policy.soft_timeout_s
    if soft is None or soft >= effective:
        # A hint below the declared soft limit would leave no room to catch it.
        soft = round(effective * SOFT_FRACTION, 3)
    return Limits(timeout_s=effective, soft_timeout_s=soft, budget_s=budget_s)


def split_meta(arguments: dict[str, Any]) -> tuple[dict[str, Any], float | None, str | None]:
    """Strip `_meta` from a call's arguments; return (arguments, hint_s, problem)."""
    if META_KEY not in arguments:
        return arguments, None, None
    args = {k: v for k, v in arguments.items() if k != META_KEY}
    meta = arguments[META_KEY]
    if not isinstance(meta, dict):
        return args, None, '_meta must be an object like {"timeout_s": 30}'
    raw = meta.get("timeout_s")
    if raw is None:
        return args, None, None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < math.inf:
        return args, None, "_meta.timeout_s must be a positive number of seconds"
    return args, float(raw), None


def overran(duration_s: float, budget_s: float) -> bool:
    return budget_s > 0 and duration_s > budget_s


def lost_deadline(
    *,
    dispatched_at: float,
    started_at: float | None,
    timeout_s: float,
    grace_s: float,
    queue_timeout_s: float,
) -> float | None:
    """When the turn settles a call lost (None: never): its queue allowance until it starts,
    then its hard limit, each plus a grace for the worker to report."""
    if started_at is None:
        return dispatched_at + queue_timeout_s + grace_s
    if timeout_s <= 0:
        return None
    return started_at + timeout_s + grace_s


def truncate_text(text: str, limit_bytes: int) -> tuple[str, int]:
    """Cut `text` to at most `limit_bytes` of UTF-8, with a marker saying how much was cut."""
    data = text.encode("utf-8")
    if len(data) <= limit_bytes:
        return text, 0
    marker_room = 80
    keep = max(0, limit_bytes - marker_room)
    head = data[:keep].decode("utf-8", errors="ignore")
    cut = len(data) - len(head.encode("utf-8"))
    return f"{head}\n[... cut {cut} of {len(data)} bytes by agentq]", cut
