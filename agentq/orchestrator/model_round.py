"""The turn's side of a model round: admitted by the capacity manager (docs/capacity.md),
sent to a stream worker, sent again when no worker holds it and it has no result; a round
refused as busy (429, 503, 529) goes back to admission without using up a retry."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from agentq import constants as k
from agentq.errors import (
    BrokerUnavailable,
    ModelBusy,
    ModelCapacityTimeout,
    ModelRoundFailed,
    StreamDurationExceeded,
)
from agentq.fleet.broker import publish, task_repr
from agentq.llm.capacity import Grant, capacity_for, waiter_of, wake_granted
from agentq.llm.limits import estimate_tokens
from agentq.models import AssistantMessage, LlmRoundRequest, LlmRoundResult
from agentq.orchestrator import spend, subturns
from agentq.state.base import now_ms
from agentq.state.turn_state import TurnState
from agentq.tools.registry import schemas_json

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext


def send_round(
    ctx: StepContext, round_no: int, attempt: int, sends: int = 1, grant: Grant | None = None
) -> None:
    """Send the round (its `attempt`, its `sends`-th send; `grant`: the capacity it was
    admitted with just now) as the step's last act, recorded as the step lets go."""
    s = ctx.settings
    streamed_s = float(ctx.state.get("streamed_s", 0.0))
    left_s = s.stream_duration_s - streamed_s
    if left_s <= 0:
        raise StreamDurationExceeded(s.stream_duration_s, streamed_s)
    req, tools = _round_request(ctx, round_no, left_s, grant)
    admissions = int(ctx.state.get("llm_admissions") or 0) + (1 if grant else 0)
    if sends > 1:  # sent again unpicked: the round keeps the deadline of its attempt
        deadline = float(ctx.state["llm_deadline"])
    else:
        idle_s = max(s.stream_idle_timeout_ms, 0) / 1000 or s.stream_duration_s
        tries_s = (s.llm_max_retries + 1) * (idle_s + s.llm_request_timeout_s)
        deadline = ctx.now + left_s + tries_s + 30
    # What the step staged, the send's record and the lock's release are one write before
    # the message goes: the stream worker reads the history this round answers and publishes
    # after the turn's events. A step that dies before the send leaves a round nobody took,
    # sent again after PICKUP_LEASES (the second delivery finds it claimed or done).
    ctx.stage(
        llm_round=round_no,
        llm_attempt=attempt,
        llm_sends=sends,
        llm_sent_at=ctx.now,
        llm_deadline=deadline,
    )
    if grant is not None:
        # The wait's start stays: `llm_queue_timeout_s` bounds the whole wait, turned away or not.
        ctx.stage(
            llm_admissions=admissions,
            llm_deployment=grant.deployment,
            llm_lease=grant.lease_id,
            llm_wait_position=None,
        )
    ctx.release(min(deadline, ctx.now + s.turn_lease_s))
    # A round the provider refused as busy is sent again under a new id.
    task_id = (
        f"{ctx.turn_id}.llm.{round_no}.{attempt}"
        + (f".{sends}" if sends > 1 else "")
        + (f".a{admissions}" if admissions > 1 else "")
    )
    if sends == 1 and attempt == 1:
        subturns.report_to_parent(ctx, f"model round {round_no + 1}")
    try:
        publish(
            ctx.app,
            k.TASK_LLM_ROUND,
            what=f"model round {round_no} of turn {ctx.turn_id}",
            kwargs=req.model_dump(),
            task_id=task_id,
            queue=k.QUEUE_LLM,
            argsrepr="()",
            kwargsrepr=task_repr(turn_id=ctx.turn_id, round_no=round_no, tools=tools),
            ignore_result=True,
        )
    except BrokerUnavailable:
        # The step after the outage sends it at once (one that took the turn: at the pickup).
        if ctx.relock():
            ctx.stage(llm_sent_at=0.0)
        raise


def _round_request(
    ctx: StepContext, round_no: int, left_s: float, grant: Grant | None
) -> tuple[LlmRoundRequest, int]:
    """What the stream worker is sent for the round, and how many tools it offers."""
    offered = ctx.offered_tools()
    req = LlmRoundRequest(
        turn_id=ctx.turn_id,
        round_no=round_no,
        tools_json=schemas_json(offered),
        duration_left_s=left_s,
        idle_timeout_ms=ctx.settings.stream_idle_timeout_ms,
        # The model the round was admitted for: its limits and its call are one model's.
        model=ctx.model,
        instructions=ctx.instructions,
        traceparent=ctx.state.get("traceparent"),
        deployment=grant.deployment if grant else ctx.state.get("llm_deployment"),
        lease_id=grant.lease_id if grant else ctx.state.get("llm_lease"),
        queued_s=max(0.0, ctx.now - float(ctx.state.get("llm_wait_since") or ctx.now))
        if grant and ctx.state.get("llm_wait_round") == round_no
        else 0.0,
        max_completion_tokens=ctx.state.get("budget_cap"),
        prompt_estimate=int(ctx.state.get("budget_prompt") or 0),
        key=ctx.state.get("owner"),
        output_format=None if ctx.agent is None else ctx.agent.output_format(),
    )
    return req, len(offered)


def poll_round(ctx: StepContext, round_no: int) -> tuple[AssistantMessage, float] | float:
    """The round's message and streamed seconds once done, else when to look again (sent if not)."""
    # Its result as the step's view holds it; one stored since, `_watch_round` finds.
    raw = ctx.state.get(k.LLM_RESULT_ROUND_FIELD) == round_no and ctx.state.get(k.LLM_RESULT_FIELD)
    result = LlmRoundResult.model_validate(raw) if raw else None
    if result is not None and not _goes_again(ctx, round_no, result):
        spend.settle_round(ctx, round_no, result)
        if result.aborted:
            # Only a cancelled turn aborts a round: the step sees the flag and aborts.
            raise ModelRoundFailed("the model round was aborted", "EABORTED")
        if not result.ok or result.message is None:
            # The stream worker's error code (ETIMEDOUT, ...) kept: clients tell failures apart.
            error = result.error or "model round failed"
            raise ModelRoundFailed(error, result.error_code or "ELLM")
        return result.message, result.streamed_s
    if ctx.state.get("llm_round") != round_no:
        spend.reserve_round(ctx, round_no)
        grant = admit(ctx, round_no)
        if not isinstance(grant, Grant):
            return grant
        send_round(ctx, round_no, 1, grant=grant)
        return _next_look(ctx)
    return _watch_round(ctx, round_no)


def admit(ctx: StepContext, round_no: int) -> Grant | float:
    """The round's grant, or when its turn should ask again (the round waits, queued)."""
    model = ctx.model
    waiting = ctx.state.get("llm_wait_round") == round_no
    since = float(ctx.state.get("llm_wait_since") or ctx.now) if waiting else ctx.now
    # The prompt as `reserve_round` estimated it, and the completion the request allows.
    tokens = estimate_tokens(int(ctx.state.get("budget_prompt") or 0), ctx.state.get("budget_cap"))
    got = capacity_for(ctx.store.redis, ctx.settings).acquire(
        model,
        waiter=waiter_of(ctx.turn_id, round_no),
        owner=str(ctx.state.get("owner") or ""),
        interactive=ctx.interactive,
        tokens=tokens,
    )
    wake_granted(ctx.store, got)
    if isinstance(got, Grant):
        return got
    waited_s = ctx.now - since
    limit_s = ctx.settings.llm_queue_timeout_s
    if waited_s >= limit_s:
        # The turn fails: its end withdraws the round (`withdraw`: it is waiting).
        raise ModelCapacityTimeout(model, waited_s)
    if not waiting or ctx.state.get("llm_wait_position") != got.position:
        # `first`: the wait starts (metrics count waiting rounds by it); later: moved up.
        queued = {
            "round_no": round_no,
            "model": model,
            "position": got.position,
            "wait_s": round(got.wait_ms / 1000, 1),
            "first": not waiting,
        }
        ctx.stage(events=[("llm_queued", queued)], llm_wait_position=got.position)
    ctx.commit(llm_wait_round=round_no, llm_wait_since=since)
    return min(got.retry_at_ms / 1000, since + limit_s)


def withdraw(ctx: StepContext) -> None:
    """An ending turn's round leaves the queue at once (a grant it had not used goes back)."""
    round_no = ctx.state.get("llm_wait_round")
    # A round that was sent is the stream worker's to give back: nothing waits here.
    if round_no is None or ctx.state.get("llm_round") == round_no:
        return
    cap = capacity_for(ctx.store.redis, ctx.settings)
    wake_granted(ctx.store, cap.withdraw(ctx.model, waiter_of(ctx.turn_id, int(round_no))))


def _next_look(ctx: StepContext) -> float:
    """A sent round is looked at again at its deadline, or a turn lease from now."""
    return min(float(ctx.state["llm_deadline"]), ctx.now + ctx.settings.turn_lease_s)


def _goes_again(ctx: StepContext, round_no: int, result: LlmRoundResult) -> bool:
    """Whether the round goes again (busy, or a failover left): its result and claim forgotten."""
    same_round = ctx.state.get("llm_failover_round") == round_no
    failovers = int(ctx.state.get("llm_failovers") or 0) if same_round else 0
    busy = result.error_code == ModelBusy.code
    if not busy and not (result.failover and failovers < ctx.settings.llm_max_retries):
        return False
    # A delivery of an earlier round still finds it done.
    fields: TurnState = {
        "llm_round": None,
        k.LLM_RESULT_FIELD: None,
        k.LLM_RESULT_ROUND_FIELD: round_no - 1,
        k.LLM_TAKEN_FIELD: None,
    }
    if not busy:
        # Its deployment failed before the model said anything: another one takes it.
        fields.update({"llm_failovers": failovers + 1, "llm_failover_round": round_no})
        retry = {
            "round_no": round_no,
            "attempt": failovers + 1,
            "code": result.error_code,
            "error": f"{result.error} (on deployment {ctx.state.get('llm_deployment')})",
            "delay_ms": 0,
            "failover": True,
        }
        ctx.stage(events=[("llm_retry", retry)])
    # A busy provider costs no retry: the round waits for capacity again.
    ctx.commit(**fields)
    return True


def _watch_round(ctx: StepContext, round_no: int) -> float:
    """A round sent, not done: fails past its deadline, goes again if abandoned; next look."""
    s = ctx.settings
    # One read: a round finished after the view has no lease, and must not look abandoned.
    raw_done, raw_taken, raw_alive = ctx.store.redis.hmget(
        k.turn_key(ctx.turn_id), [k.LLM_RESULT_ROUND_FIELD, k.LLM_TAKEN_FIELD, k.LLM_ALIVE_FIELD]
    )
    if raw_done is not None and json.loads(raw_done) == round_no:
        return ctx.now  # the step goes on from a view that holds the result
    if ctx.now >= float(ctx.state.get("llm_deadline") or 0):
        raise ModelRoundFailed("no stream worker answered the model round in time", "ELLM")
    alive = k.llm_alive(raw_alive, round_no, now_ms())
    if not alive and raw_taken is not None and json.loads(raw_taken) == round_no:
        # Taken, and its lease lapsed without a result: the stream worker died.
        attempt = int(ctx.state.get("llm_attempt", 1))
        if attempt > s.llm_max_retries:
            raise ModelRoundFailed(
                f"the stream worker died mid-round (attempt {attempt} of {s.llm_max_retries + 1})",
                "EWORKERLOST",
            )
        ctx.publish(
            "llm_retry",
            round_no=round_no,
            attempt=attempt,
            code="EWORKERLOST",
            error="the stream worker stopped mid-round; the round is sent again",
            delay_ms=0,
            restart=True,
        )
        ctx.store.redis.hdel(k.turn_key(ctx.turn_id), k.LLM_TAKEN_FIELD)
        send_round(ctx, round_no, attempt + 1)
    elif not alive:
        sent_at = float(ctx.state.get("llm_sent_at", ctx.now))
        if ctx.now - sent_at >= k.PICKUP_LEASES * s.turn_lease_s:
            # A delivery that arrives after all finds the result or the claim: not run twice.
            sends = int(ctx.state.get("llm_sends") or 1) + 1
            send_round(ctx, round_no, int(ctx.state.get("llm_attempt", 1)), sends)
    return _next_look(ctx)
