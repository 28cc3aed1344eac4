"""The policy a tool runs under: a small frozen model, checked when the tool is declared."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentq.constants import QUEUE_TOOLS
from agentq.models import InteractionKind

Concurrency = Literal["parallel", "exclusive"]
Approval = Literal["auto", "ask", "deny"]


class ToolPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(120.0, ge=0)
    """Hard limit: the worker process is killed; 0 means no limit."""
    soft_timeout_s: float | None = Field(None, gt=0)
    """Soft limit raised inside the tool; default 0.9 x timeout_s."""
    budget_s: float = Field(10.0, ge=0)
    """Advisory: only measured, sets `overran`."""
    max_timeout_s: float | None = Field(None, ge=0)
    """Ceiling for a per-call `_meta.timeout_s` hint; default timeout_s."""
    concurrency: Concurrency = "parallel"
    approval: Approval = "auto"
    approval_kind: InteractionKind = "approval"
    approval_timeout_s: float | None = Field(None, gt=0)
    """Finite wait for an answer; default per kind from the settings."""
    approval_default: Literal["approve", "deny"] | None = None
    """What a headless turn does without asking; unset fails the headless turn."""
    queue: str = QUEUE_TOOLS
    idempotent: bool = False
    """A call lost with its worker process is run again instead of settling as lost."""
    max_retries: int = Field(1, ge=0, le=10)

    @model_validator(mode="after")
    def _coherent(self) -> ToolPolicy:
        if (
            self.timeout_s > 0
            and self.soft_timeout_s is not None
            and self.soft_timeout_s >= self.timeout_s
        ):
            raise ValueError(
                f"soft_timeout_s ({self.soft_timeout_s:g}) must be below "
                f"timeout_s ({self.timeout_s:g})"
            )
        if (
            self.max_timeout_s is not None
            and self.timeout_s > 0
            and 0 < self.max_timeout_s < self.timeout_s
        ):
            raise ValueError("max_timeout_s must not be below timeout_s")
        if (
            self.approval == "ask"
            and self.approval_kind == "device_code"
            and self.approval_timeout_s is None
        ):
            raise ValueError("a device_code interaction must declare a finite approval_timeout_s")
        return self
