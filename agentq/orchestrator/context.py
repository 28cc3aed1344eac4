"""What one step of a turn carries: the turn's state as read, and the lock token that fences it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Unpack, cast

from agentq.agents import Agent, AgentTool
from agentq.config import Settings
from agentq.errors import StepLost
from agentq.models import ToolResult, TurnStatus
from agentq.state.base import RoundRead
from agentq.state.steplock import Released
from agentq.state.turn_state import TurnState
from agentq.state.turns import Closed
from agentq.telemetry import tracing
from agentq.tools.registry import ToolSpec, all_tools

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore


@dataclass
class StepContext:
    turn_id: str
    store: TurnStore
    app: Celery
    settings: Settings
    token: str
    state: TurnState
    history: list[dict[str, Any]] = field(default_factory=list)
    """The turn's history as this step knows it: read when it began, plus what it appended."""
    cancel_reason: str | None = None
    now: float = field(default_factory=time.time)
    agent: Agent | None = None
    """The turn's agent; `settings` already carry its overrides."""
    round_read: RoundRead | None = None
    """Its round's calls as stored when the step began (or as it planned them); used once."""
    dispatched: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Dispatch records of the calls this step sends, written as it lets go of its lock."""
    ended: str | None = None
    """The status this step ended the turn with (None: the turn goes on)."""
    lock_ms: int = field(kw_only=True)

    @property
    def headless(self) -> bool:
        return bool(self.state.get("headless"))

    @property
    def model(self) -> str:
        """The turn's own model (a retry's or fork's), else its agent's, else the settings'."""
        agent_model = self.agent.model if self.agent is not None else None
        return self.state.get("model") or agent_model or self.settings.llm_model

    @property
    def instructions(self) -> str:
        """Its rounds' system message: its own (a fork's edit), else its agent's."""
        agent_says = "" if self.agent is None else self.agent.system_message()
        return self.state.get("instructions") or agent_says

    def offered_tools(self) -> list[ToolSpec | AgentTool]:
        """What the turn's model rounds are offered: its agent's tools, else every tool."""
        return list(all_tools().values()) if self.agent is None else self.agent.offered_tools()

    @property
    def interactive(self) -> bool:
        """A person follows the turn (or its parent): its model rounds are served first."""
        if "interactive" in self.state:
            return bool(self.state["interactive"])
        return not (self.state.get("detach") or self.headless)

    staged: tuple[TurnState, list[tuple[str, dict[str, Any]]]] = field(
        default_factory=lambda: (TurnState(), [])
    )
    """State fields and events `stage`d for the step's next write (see `stage`)."""
    staged_append: list[dict[str, Any]] = field(default_factory=list)
    """History messages `stage`d for the step's next write, after the ones it wrote."""
    staged_plans: dict[str, str] = field(default_factory=dict)
    """Call plans (call id -> CallPlan JSON) `stage`d for the step's next write."""
    released: Released | None = None
    """Set by `release`: RELEASED, or WOKEN (the lock kept: the step reads again, goes on)."""

    def stage(
        self,
        events: list[tuple[str, dict[str, Any]]] | None = None,
        append: list[dict[str, Any]] | None = None,
        plans: dict[str, str] | None = None,
        **fields: Unpack[TurnState],
    ) -> None:
        """Record state fields, events, history messages and call plans with the step's next
        write: for a change nothing outside the step acts on before then (one write, not two)."""
        self.state.update(fields)
        self.staged[0].update(fields)
        self.staged[1].extend(events or [])
        self.staged_append.extend(append or [])
        self.staged_plans.update(plans or {})
        self.history.extend(append or [])

    def flush(self) -> None:
        if self.staged[0] or self.staged[1] or self.staged_append or self.staged_plans:
            self.commit()

    def release(self, next_at: float | None) -> None:
        """Let go of the lock with what was staged and the calls to send; `next_at` for sweeps."""
        self.released = self._write(next_at)

    def _write(self, next_at: float | None, *, keep: bool = False) -> Released:
        """Write what was staged, fenced by the step's lock; let go of it unless `keep`."""
        got = self.store.release_step(
            self.turn_id,
            self.token,
            next_at,
            0 if keep else self.lock_ms,
            # The calls to send are recorded only as the lock goes: a commit leaves them.
            {} if keep else self.dispatched,
            fields=self.staged[0],
            events=self.staged[1],
            append=self.staged_append,
            plans=self.staged_plans,
            keep=keep,
        )
        if got is Released.LOST or (keep and got is not Released.KEPT):
            raise StepLost(self.turn_id)
        self.staged, self.staged_append, self.staged_plans = ({}, []), [], {}
        if not keep:
            self.dispatched = {}
        return got

    def relock(self) -> bool:
        """Take the lock again after `release` (its last act failed); False if another has it."""
        if self.released is Released.RELEASED and not self.store.lock_step(
            self.turn_id, self.token, self.lock_ms
        ):
            return False
        self.released = None
        return True

    def commit(
        self,
        append: list[dict[str, Any]] | None = None,
        *,
        events: list[tuple[str, dict[str, Any]]] | None = None,
        **fields: Unpack[TurnState],
    ) -> None:
        """Write state fields, history messages and events now, after what was staged."""
        self.stage(events, append, **fields)
        self._write(None, keep=True)

    def close(
        self,
        status: TurnStatus,
        event_fields: dict[str, Any],
        settle_parent: tuple[str, ToolResult] | None,
        append: list[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> None:
        """End the turn (status, `turn_<status>`, TTL, `append`, a parent's call) in one write."""
        if self.staged[1] or self.staged_plans:
            self.flush()  # what was staged comes first, its events before the terminal one
        else:
            # Staged fields alone are written with the end: one write instead of two.
            fields = {**self.staged[0], **fields}
            self.staged = ({}, [])
        staged_append, self.staged_append = self.staged_append, []
        won = self.store.close(
            self.turn_id,
            status,
            f"turn_{status.value}",
            event_fields,
            settle_parent=settle_parent,
            token=self.token,
            append=[*staged_append, *(append or [])],
            hands_off=bool(self.state.get("conversation_id") or self.state.get("webhook_url")),
            **fields,
        )
        if won is Closed.LOST:
            raise StepLost(self.turn_id)
        if won is not Closed.ENDED_ALREADY:
            self.ended = status.value
            self.history.extend(append or [])
            # For what follows in this step (the hand-off reads the abort reason).
            self.state.update(cast(TurnState, {"status": status.value, **fields}))

    def settle(self, result: ToolResult, *, tracked: bool = True) -> tuple[ToolResult, bool]:
        """Settle a call, the one way a step does (traced, no wake, after what it staged): the
        result it keeps (the first wins), and whether that is `result`; untracked: never sent."""
        self.flush()
        if self.store.settle(self.turn_id, result, wake=False, tracked=tracked):
            if tracing.enabled:
                tracing.record_settled(self.state.get("traceparent"), self.turn_id, result)
            return result, True
        return self.store.result(self.turn_id, result.call_id) or result, False

    def publish(self, type_: str, **fields: Any) -> int:
        self.flush()  # events in the order the step meant them
        return self.store.bus.publish(self.turn_id, type_, **fields)
