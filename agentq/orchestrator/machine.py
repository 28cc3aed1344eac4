"""The turn's life: a state machine kept in Redis and advanced by short steps.

Transitions (``status`` in the turn's hash, and ``phase`` while it runs; "=": the same):

==============  ======================================  ============================================
from            on                                      to (what the step does)
==============  ======================================  ============================================
queued          its first step                          running:model (turn_started, round sent)
running:model   round sent, no result yet               = (look again: deadline, heartbeat)
running:model   its stream worker died (no heartbeat)   = (sent again, llm_max_retries times)
running:model   an answer without tool calls            finished (turn_finished, typed output kept)
running:model   an answer its output type refuses       = (the errors as a user message; once)
running:model   ... refused a second time               error (turn_error, invalid_output)
running:model   an answer with tool calls               running:tools (message kept, calls planned)
running:model   the round failed, or no worker in time  error (turn_error)
running:tools   an approval still pending               = (look again at its timeout)
running:tools   a batch settled                         = (next batch)
running:tools   a call overdue, or its worker dead      = (settled lost)
running:tools   an agent call planned                   = (child turn started, subturn_started)
running:tools   an agent call past its limit            = (settled timeout, child aborted)
running:tools   an agent call's heartbeat is due        = (tool_progress: the child's phase)
running:tools   every call settled                      running:model (tool messages, next round)
running:tools   every call settled, and a stop reason   finished (max_calls_per_turn, loop_detected)
running:tools   a headless ask, no declared default     error (turn_error, exit 4)
queued/running  the cancel flag                         aborted (tasks revoked, calls cancelled)
queued/running  an unexpected failure                   error (turn_error)
queued/running  an agent this worker does not run       error (turn_error)
==============  ======================================  ============================================

A turn ends in one write fenced by the step's lock (the round's last tool messages, status,
terminal event, retention TTL, and the parent's call a child turn settles), so nothing is
published after the end; its children still running are then aborted.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import ValidationError

from agentq import constants as k
from agentq.agents import all_agents
from agentq.errors import AgentqError, ConversationNotFound, describe_invalid
from agentq.fleet.broker import revoke
from agentq.models import (
    TERMINAL_STATUSES,
    ToolCall,
    ToolResult,
    TurnStatus,
    final_content,
)
from agentq.orchestrator import conversation, model_round, spend, subturns
from agentq.orchestrator.approvals import gate
from agentq.orchestrator.dispatch import advance_calls
from agentq.orchestrator.plan import (
    CallPlan,
    calls_of,
    history_form,
    limit_checks,
    oversize_refusal,
    pending_calls,
    plan_call,
    with_safe_call_ids,
)
from agentq.orchestrator.wake import abort_running
from agentq.state.base import RoundRead
from agentq.state.turn_state import TurnState
from agentq.tools.registry import get_tool
from agentq.tools.results import cancelled_result, denied_result, error_result, lost_result

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext

MAX_TRANSITIONS_PER_STEP = 50
"""A bound on one step's work; a turn with more to do wakes itself for another step."""

GO_ON: Final = "go_on"
Phase = float | None | Literal["go_on"]
"""A phase's answer: GO_ON (on to the next transition), or what `advance` returns."""


def advance(ctx: StepContext) -> float | None:
    """Take the turn as far as it can go now; when to look again (None: only a wake, or ended)."""
    if ctx.state.get("status") in TERMINAL_STATUSES:
        return None
    if ctx.cancel_reason is not None:
        abort_turn(ctx, ctx.cancel_reason)
        return None
    name = ctx.state.get("agent")
    if name and ctx.agent is None:
        known = ", ".join(sorted(all_agents())) or "none"
        fail(ctx, "unknown_agent", f"this worker runs no agent {name!r} (it runs: {known})")
        return None
    if ctx.state.get("status") == TurnStatus.QUEUED.value:
        begun = _begin(ctx)
        if begun != GO_ON:
            return begun
    for _ in range(MAX_TRANSITIONS_PER_STEP):
        pending = pending_calls(ctx.history)
        got = _collect_calls(ctx, pending) if pending else _model_round(ctx)
        if got != GO_ON:
            return got
    return ctx.now  # more to do than one step should take: step again at once


def _begin(ctx: StepContext) -> Phase:
    """A queued turn starts (once its conversation lets it): turn_started, staged."""
    if ctx.state.get("conversation_waiting"):
        try:
            wait = conversation.take_turn(ctx)
        except ConversationNotFound as exc:
            fail(ctx, "conversation_gone", exc.message)
            return None
        if wait is not None:
            return wait
    st = ctx.state
    started = {f: st.get(f) for f in ("conversation_id", "agent", "parent_turn_id")}
    started |= {f: st.get(f) for f in ("retry_of", "fork_of", "from_round") if st.get(f)}
    # With the step's first write, before anything acts on it: one write fewer per turn.
    ctx.stage(
        events=[("turn_started", {**started, "headless": ctx.headless})],
        status=TurnStatus.RUNNING.value,
        started_at=ctx.now,
        phase="model",
    )
    if ctx.state.get("retry_of"):
        # Its settled calls came with the view (`round_calls`); those the source lost: now.
        _settle_replay_lost(ctx)
        return GO_ON
    # Nothing of its calls is stored yet: the ones it came with are read as they are.
    ids = tuple(c.id for c in pending_calls(ctx.history))
    ctx.round_read = RoundRead.unsent(ids) if ids else None
    return GO_ON


def _settle_replay_lost(ctx: StepContext) -> None:
    """A retry's calls its source lost run again if idempotent (or `rerun_lost`), else lost."""
    lost = set(ctx.state.get("replay_lost") or [])
    if not lost or ctx.state.get("rerun_lost"):
        return
    source = ctx.state.get("retry_of")
    for call in pending_calls(ctx.history):
        if call.id not in lost or _idempotent(call.name):
            continue
        why = f"it ran in turn {source}, which ended before its result came"
        ctx.settle(lost_result(call, why), tracked=False)
        ctx.round_read = None  # read again: this result is not in the view's


def _idempotent(name: str) -> bool:
    try:
        return get_tool(name).policy.idempotent
    except AgentqError:  # an agent called as a tool, or a tool no longer loaded
        return False


def _model_round(ctx: StepContext) -> Phase:
    """The turn's model round, sent or looked at; once answered, its calls planned, or the end."""
    round_no = int(ctx.state.get("round", 0))
    if ctx.state.get("inject_seq") and ctx.state.get("llm_round") != round_no:
        # Before the round is sent: messages sent to join the turn go in it.
        conversation.take_injected(ctx)
    outcome = model_round.poll_round(ctx, round_no)
    if isinstance(outcome, float):
        return outcome
    message, streamed_s = outcome
    message = with_safe_call_ids(message, {c.id for c in calls_of(ctx.history)}, round_no)
    earlier = calls_of(ctx.history, int(ctx.state.get("history_start", 0)))
    refused, stop = limit_checks(
        earlier,
        list(message.tool_calls),
        max_calls=ctx.settings.max_calls_per_turn,
        loop_threshold=ctx.settings.loop_threshold,
    )
    kept, too_big = history_form(message, ctx.settings.max_arguments_bytes)
    refused = {**too_big, **refused}
    plans = {
        c.id: plan_call(c, refused.get(c.id), ctx.agent).model_dump_json()
        for c in message.tool_calls
    }
    counts: TurnState = {
        "round": round_no + 1,
        "stop_after_round": stop,
        "call_count": len(earlier) + len(message.tool_calls),
        "streamed_s": float(ctx.state.get("streamed_s", 0.0)) + streamed_s,
        "phase": "tools" if message.tool_calls else "model",
        "round_calls": list(plans) or None,
        k.LLM_RESULT_FIELD: None,  # in the history from now on
    }
    if not message.tool_calls:
        return _final_answer(ctx, kept, counts)
    # Written with the calls' records (or the step's next write), before any call is sent.
    ctx.stage(append=[kept], plans=plans, **counts)
    # Calls this new are neither sent nor settled: the step goes on without a read.
    ctx.round_read = RoundRead.unsent(tuple(plans), list(plans.values())) if plans else None
    return GO_ON


def _final_answer(ctx: StepContext, kept: dict[str, Any], counts: TurnState) -> Phase:
    """An answer without calls ends the turn; an agent's `output_type` validates it (stored as
    `output`), and an invalid one goes back to the model OUTPUT_RETRIES times with the errors."""
    ctx.stage(**counts)  # written with the end, or with the retry's message
    output_type = None if ctx.agent is None else ctx.agent.output_type
    if output_type is None:
        finish(ctx, "stop", append=[kept])
        return None
    content = str(kept.get("content") or "").strip()
    # Models often fence JSON as a code block: the fence is not part of the answer.
    fenced = _FENCE.match(content)
    try:
        value = output_type.model_validate_json(fenced.group(1) if fenced else content)
    except ValidationError as exc:
        problems = describe_invalid(exc, "answer", ERRORS_SHOWN)
        name, retries = output_type.__name__, int(ctx.state.get("output_retries") or 0)
        if retries >= OUTPUT_RETRIES:
            ctx.commit(append=[kept])
            fail(ctx, "invalid_output", f"the final answer is not a valid {name}: {problems}")
            return None
        retry = {
            "role": "user",
            "content": f"Your answer is not a valid {name}: {problems}. Answer again "
            "with only one JSON object that matches the schema.",
        }
        ctx.commit(append=[kept, retry], output_retries=retries + 1)
        return GO_ON
    finish(ctx, "stop", append=[kept], output=value.model_dump(mode="json"))
    return None


OUTPUT_RETRIES = 1
"""How many times an invalid final answer goes back to the model."""
ERRORS_SHOWN = 10
"""Validation errors quoted to the model and in the turn's error, at most."""
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*)\n```$", re.DOTALL)


def _plans(ctx: StepContext, calls: list[ToolCall], raw: list[bytes | None]) -> list[CallPlan]:
    """The round's plans as stored; calls that came with the prompt are planned now."""
    plans = [
        CallPlan.model_validate_json(r)
        if r
        else plan_call(c, oversize_refusal(c, ctx.settings.max_arguments_bytes), ctx.agent)
        for c, r in zip(calls, raw, strict=True)
    ]
    # With the step's next write (nothing of the round runs before it).
    new = {p.call.id: p.model_dump_json() for p, r in zip(plans, raw, strict=True) if not r}
    if new:
        ctx.stage(plans=new, round_calls=[c.id for c in calls])
    return plans


def _collect_calls(ctx: StepContext, pending: list[ToolCall]) -> Phase:
    """The round's calls gated and run; once all are settled, their tool messages (or the end)."""
    ids = [c.id for c in pending]
    # One read for the whole round: a result that lands after it wakes the turn again.
    read, ctx.round_read = ctx.round_read, None  # used once
    raw_plans, settled, dispatched = ctx.store.round_view(ctx.turn_id, ids, read=read)
    plans = _plans(ctx, pending, raw_plans)
    # A settled call is never asked about; a request of one still open closes at its timeout.
    decided = gate(ctx, plans, settled)
    for p in plans:
        cid, result = p.call.id, decided.results.get(p.call.id)
        if result is None or cid in settled:
            continue
        settled[cid], won = ctx.settle(result, tracked=False)
        if won and result.status == "denied":
            ctx.publish("tool_denied", call_id=cid, tool=p.call.name, reason=result.reason)
    if decided.wait_until is not None:
        # No call of a round runs before every call of it is decided.
        return decided.wait_until
    runnable = [p for p in plans if p.call.id not in settled]
    wake_at = advance_calls(ctx, runnable, settled, dispatched, decided.secrets)
    if any(cid not in settled for cid in ids):
        return wake_at
    if decided.secrets:
        ctx.store.redis.delete(*decided.secrets.values())
    messages = [settled[cid].to_openai() for cid in ids]
    stop = ctx.state.get("stop_after_round")
    if stop:
        finish(ctx, str(stop), append=messages)
        return None
    ctx.stage(append=messages, phase="model")
    return GO_ON


def finish(
    ctx: StepContext,
    reason: str,
    append: list[dict[str, Any]] | None = None,
    output: Any = None,
) -> None:
    """End the turn with turn_finished (`output`: the agent's typed answer, as JSON)."""
    # A round whose calls were its last (stop_after_round) is settled here.
    spend.settle_left(ctx)
    content = final_content([*ctx.history, *(append or [])])
    typed = {} if output is None else {"output": output}
    ctx.close(
        TurnStatus.FINISHED,
        {
            "reason": reason,
            "content": content,
            "rounds": ctx.state.get("round"),  # its own: not its conversation's earlier ones
            **typed,
        },
        subturns.parent_settlement(
            ctx,
            "finished",
            # A parent gets the typed value, as the validated JSON.
            content if output is None else json.dumps(output, separators=(",", ":")),
        ),
        append=append,
        finish_reason=reason,
        finished_at=ctx.now,
        **typed,
    )


def fail(ctx: StepContext, code: str, message: str, **fields: Any) -> None:
    """End the turn with turn_error, every call of its round settled first."""
    headless = code == "headless_interaction"
    msgs, ours = _wind_up(
        ctx,
        "error",
        lambda call, _: (
            denied_result(call, "policy")
            if headless
            else error_result(call, f"not run: the turn failed ({message})")
        ),
    )
    ctx.close(
        TurnStatus.ERROR,
        {"code": code, "error": message, **fields},
        subturns.parent_settlement(ctx, "error", message),
        append=msgs,
        error=message,
        error_code=code,
        end_settled=ours or None,
    )


def abort_turn(ctx: StepContext, reason: str) -> None:
    """Revoke what runs, settle every call as cancelled, end with turn_aborted."""
    revoked = revoke_unsettled(ctx)
    msgs, ours = _wind_up(
        ctx,
        reason,
        lambda call, dispatch: cancelled_result(call, reason, task_id=dispatch.get("task_id")),
    )
    ctx.close(
        TurnStatus.ABORTED,
        {"reason": reason, "revoked": len(revoked), "cancelled_calls": len(msgs)},
        subturns.parent_settlement(ctx, "aborted", reason),
        append=msgs,
        abort_reason=reason,
        end_settled=ours or None,
    )


def revoke_unsettled(ctx: StepContext) -> list[str]:
    """SIGTERM the turn's started tasks (one not started sees the cancel flag), and leave a
    SIGKILL after a grace as an order in Redis the sweepers send (`send_kills`): a tool that
    ignores SIGTERM dies even when the aborting process has exited."""
    running = ctx.store.running_tasks(ctx.turn_id)
    if not running:
        return []
    ids = list(running)
    workers = [start.get("worker") for start in running.values()]
    # A start record without a worker name (never expected) falls back to a broadcast.
    destination = sorted({str(w) for w in workers}) if all(workers) else None
    revoke(ctx.app, ids, terminate=True, signal="SIGTERM", destination=destination)
    # Celery forgets a task it terminated (a SIGKILL revoke finds nothing): name the pids.
    targets = [[tid, start.get("pid")] for tid, start in running.items() if start.get("pid")]
    if targets:
        order = json.dumps({"targets": targets, "to": destination}, separators=(",", ":"))
        ctx.store.redis.zadd(k.KILLS, {order: time.time() + ctx.settings.abort_kill_grace_s})
    return ids


def _wind_up(
    ctx: StepContext, why: str, result_for: Callable[[ToolCall, dict[str, Any]], ToolResult]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Before an end without an answer: the round withdrawn and its spend settled, each open
    call settled, the children aborted; the round's tool messages (so the history stays
    valid), and the ids of the calls settled here (the ones a retry runs again)."""
    model_round.withdraw(ctx)
    spend.settle_left(ctx)
    # A turn that never read its conversation settles what its pending messages left open.
    waiting = ctx.state.get("conversation_waiting")
    calls = pending_calls(list(ctx.state.get("pending_messages") or []) if waiting else ctx.history)
    ours: list[str] = []
    settled: dict[str, ToolResult] = {}
    if calls:
        _, settled, dispatched = ctx.store.round_view(ctx.turn_id, [c.id for c in calls])
        for call in calls:
            if call.id in settled:
                continue
            mine = result_for(call, dispatched.get(call.id, {}))
            settled[call.id], won = ctx.settle(mine, tracked=call.id in dispatched)
            if won:
                ours.append(call.id)
        # A password answer is read once by its tool; a round that ends must not leave one.
        secrets = [k.turn_key(ctx.turn_id, "secret", f"{c.id}.approval") for c in calls]
        ctx.store.redis.delete(*secrets)
    abort_running(ctx.store, ctx.store.children(ctx.turn_id), why, walk=False)
    return [settled[c.id].to_openai() for c in calls], ours
