"""The policy a tool runs under: a small frozen model, checked when the tool is declared.
A field left unset (None) takes its default where the tool is loaded (`resolved`); "no
limit" is `0` everywhere: in the policy, the settings, the per-call limits and the task
request."""

from __future__ import annotations

from typing import Literal

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
        if (
            self.approval == "ask"
            and self.approval_kind == "device_code"
            and self.approval_timeout_s is None
        ):
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
