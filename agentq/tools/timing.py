"""Pure decisions that depend on time: limits, hints, deadlines, budgets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentq.tools.policy import ToolPolicy

SOFT_FRACTION = 0.9
META_KEY = "_meta"


@dataclass(frozen=True)
class Limits:
    """The limits one call runs under; 0 means unlimited."""

    timeout_s: float
    soft_timeout_s: float
    budget_s: float

    @property
    def celery_options(self) -> dict[str, float]:
        if self.timeout_s <= 0:
            return {}
        return {"time_limit": self.timeout_s, "soft_time_limit": self.soft_timeout_s}


def effective_limits(policy: ToolPolicy, hint_s: float | None) -> Limits:
    """Apply a per-call hint to a tool's policy (resolved, or with unset limits meaning
    none), clamped to the tool's ceiling."""
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
    """When the turn settles a call as lost (None: never): its queue allowance until it
    starts, then its hard limit, each plus a grace for the worker to report."""
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
