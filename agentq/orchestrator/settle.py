"""A turn's step settles a call itself (refused, denied, lost, timed out, cancelled): one
path, always traced.

The first result stored for a call wins (`TurnStore.settle`): a step that settles a call a
worker settled meanwhile keeps the worker's. Every place a step gives a call its result
goes through here, so that rule and its span are written once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentq.models import ToolResult
from agentq.telemetry import tracing

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


def settle_in_step(
    ctx: StepContext, result: ToolResult, *, tracked: bool = True
) -> tuple[ToolResult, bool]:
    """Settle one of the turn's calls from its own step (no wake: the step goes on), after
    what the step staged, so its tool_finished follows the events the step meant before
    it: the result the call keeps, and whether it is `result`.

    `tracked=False` for a call never recorded as sent (refused, denied). A result stored
    first wins: it is read back and returned."""
    ctx.flush()
    if ctx.store.settle(ctx.turn_id, result, wake=False, tracked=tracked):
        if tracing.enabled:
            tracing.record_settled(ctx.state.get("traceparent"), ctx.turn_id, result)
        return result, True
    return ctx.store.result(ctx.turn_id, result.call_id) or result, False
