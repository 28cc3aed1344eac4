"""The turn loop: model round, approval gate, dispatch, one tool-result message, repeat."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Any

import redis
from celery import Celery

from agentq import constants as k
from agentq.config import get_settings
from agentq.errors import (
    Aborted,
    HeadlessInteraction,
    LlmError,
    StreamDurationExceeded,
)
from agentq.models import (
    TERMINAL_STATUSES,
    AssistantMessage,
    LlmRoundRequest,
    LlmRoundResult,
    ToolCall,
)
from agentq.orchestrator.abort import finalize_abort, pending_calls, settle_pending
from agentq.orchestrator.approvals import gate
from agentq.orchestrator.context import TurnContext
from agentq.orchestrator.dispatch import RoundDispatcher, canonical_call
from agentq.orchestrator.lease import LeaseKeeper, holder_id
from agentq.results import denied_result, error_result
from agentq.runtime import get_app, get_store
from agentq.tools.registry import all_tools

log = logging.getLogger("agentq.turn")
_keeper: LeaseKeeper | None = None


def _lease_keeper() -> LeaseKeeper:
    global _keeper
    if _keeper is None:
        _keeper = LeaseKeeper(get_store(), get_settings().turn_lease_s)
    return _keeper


def turn_calls(history: list[dict[str, Any]], start: int) -> list[ToolCall]:
    out = []
    for msg in history[start:]:
        for c in msg.get("tool_calls") or []:
            out.append(
                ToolCall(
                    id=c["id"],
                    name=c["function"]["name"],
                    arguments=c["function"].get("arguments") or "{}",
                )
            )
    return out


def limit_checks(
    earlier: list[ToolCall], new: list[ToolCall], *, max_calls: int, loop_threshold: int
) -> tuple[dict[str, str], str | None]:
    """Which new calls must not run (call id -> why), and why the turn stops after this round."""
    refused: dict[str, str] = {}
    stop: str | None = None
    seen = Counter(canonical_call(c) for c in earlier)
    budget = max_calls - len(earlier)
    for call in new:
        key = canonical_call(call)
        seen[key] += 1
        if budget <= 0:
            refused[call.id] = (
                f"not run: this turn reached max_calls_per_turn={max_calls}. "
                "Answer the user with what you have."
            )
            stop = "max_calls_per_turn"
            continue
        budget -= 1
        if seen[key] >= loop_threshold:
            refused[call.id] = (
                f"not run: the same call ({call.name} with the same arguments) was made "
                f"{seen[key]} times this turn; the loop detector stopped it."
            )
            stop = stop or "loop_detected"
    return refused, stop


def history_form(
    msg: AssistantMessage, max_arguments_bytes: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """The assistant message as kept in history, and the calls refused for their size.

    Oversized arguments are replaced: the call is refused anyway, and keeping megabytes
    of arguments would send them back to the model with every later round.
    """
    out = msg.to_openai()
    refused: dict[str, str] = {}
    for call in out.get("tool_calls") or []:
        size = len(call["function"]["arguments"].encode("utf-8"))
        if size > max_arguments_bytes:
            call["function"]["arguments"] = json.dumps(
                {"_removed_by_agentq": f"{size} bytes of arguments, over the limit"}
            )
            refused[call["id"]] = (
                f"invalid arguments for tool {call['function']['name']!r}: arguments are "
                f"{size} bytes, over the limit of {max_arguments_bytes} bytes; pass a "
                "reference (a path, an id) instead of the data"
            )
    return out, refused


class Turn:
    def __init__(self, ctx: TurnContext, state: dict[str, Any]) -> None:
        self.ctx = ctx
        self.state = state

    def llm_round(self, round_no: int) -> AssistantMessage:
        ctx, s = self.ctx, self.ctx.settings
        raw = ctx.store.redis.get(k.llm_result_key(ctx.turn_id, round_no))
        result = None if raw is None else LlmRoundResult.model_validate_json(raw)
        if result is None:
            streamed_s = float(self.state.get("streamed_s", 0.0))
            left_s = s.stream_duration_s - streamed_s
            if left_s <= 0:
                raise StreamDurationExceeded(s.stream_duration_s, streamed_s)
            req = LlmRoundRequest(
                turn_id=ctx.turn_id,
                round_no=round_no,
                tools=[t.openai_schema() for t in all_tools().values()],
                duration_left_s=left_s,
                idle_timeout_ms=s.stream_idle_timeout_ms,
            )
            result = self._await_llm(req)
            self.state["streamed_s"] = float(self.state.get("streamed_s", 0.0)) + result.streamed_s
            ctx.store.update(ctx.turn_id, streamed_s=self.state["streamed_s"])
        if result.aborted:
            ctx.check_abort()
            raise Aborted(ctx.turn_id, "user")
        if not result.ok or result.message is None:
            err = LlmError(result.error or "model round failed")
            # The stream worker's typed error crossed a process boundary as text;
            # keep its code (ETIMEDOUT, ...) so clients can tell failures apart.
            err.code = result.error_code or "ELLM"
            raise err
        return result.message

    def _await_llm(self, req: LlmRoundRequest) -> LlmRoundResult:
        """Send the round and wait for it; send it again if its stream worker dies."""
        ctx, s = self.ctx, self.ctx.settings
        deadline = self._send_llm(req)
        alive = k.llm_alive_key(req.turn_id, req.round_no)
        done = k.llm_result_key(req.turn_id, req.round_no)
        seen_alive, resends = False, 0
        while True:
            now = time.time()
            if now >= deadline:
                raise LlmError("no stream worker answered the model round in time")
            msg = ctx.wait_until(min(deadline, now + s.turn_lease_s / 2))
            if msg is not None:
                if msg.get("kind") == "llm" and msg.get("round_no") == req.round_no:
                    return LlmRoundResult.model_validate(msg["result"])
                continue
            if ctx.store.redis.exists(alive):
                seen_alive = True
            elif seen_alive and not ctx.store.redis.exists(done):
                # The heartbeat lapsed without a result: the stream worker died mid-round.
                if resends >= s.llm_max_retries:
                    err = LlmError(
                        "the stream worker died mid-round "
                        f"(attempt {resends + 1} of {s.llm_max_retries + 1})"
                    )
                    err.code = "EWORKERLOST"
                    raise err
                resends += 1
                seen_alive = False
                ctx.publish(
                    "llm_retry",
                    round_no=req.round_no,
                    attempt=resends,
                    code="EWORKERLOST",
                    error="the stream worker stopped mid-round; the round is sent again",
                    delay_ms=0,
                    restart=True,
                )
                deadline = self._send_llm(req)

    def _send_llm(self, req: LlmRoundRequest) -> float:
        """Send one model round to a stream worker; return when to give up waiting for it."""
        ctx, s = self.ctx, self.ctx.settings
        attempt = int(self.state.get("llm_attempt", 0)) + 1
        self.state["llm_attempt"] = attempt
        ctx.store.update(ctx.turn_id, llm_attempt=attempt)
        ctx.app.send_task(
            k.TASK_LLM_ROUND,
            kwargs=req.model_dump(),
            task_id=f"{ctx.turn_id}.llm.{req.round_no}.{attempt}",
            queue=k.QUEUE_LLM,
            ignore_result=True,
        )
        idle_s = max(s.stream_idle_timeout_ms, 0) / 1000 or s.stream_duration_s
        return (
            time.time()
            + req.duration_left_s
            + (s.llm_max_retries + 1) * (idle_s + s.llm_request_timeout_s)
            + 30
        )

    def run_round(self, calls: list[ToolCall], refused: dict[str, str]) -> None:
        ctx = self.ctx
        presettled = {c.id: error_result(c, refused[c.id]) for c in calls if c.id in refused}
        allowed = [c for c in calls if c.id not in refused]
        outcome = gate(ctx, allowed)
        presettled.update(outcome.denied)
        results = RoundDispatcher(ctx).run(calls, presettled=presettled, secrets=outcome.secrets)
        ctx.store.append_history(ctx.turn_id, *[r.to_openai() for r in results])

    def run(self) -> str:
        ctx = self.ctx
        start = int(self.state.get("history_start", 0))
        while True:
            ctx.check_abort()
            history = ctx.store.history(ctx.turn_id)
            pending = pending_calls(history)
            if pending:
                refused = self.state.get("refused") or {}
                self.run_round(pending, refused)
                stop = self.state.get("stop_after_round")
                if stop:
                    return str(stop)
                continue
            round_no = int(self.state.get("round", 0))
            msg = self.llm_round(round_no)
            earlier = turn_calls(history, start)
            refused, stop = limit_checks(
                earlier,
                list(msg.tool_calls),
                max_calls=ctx.settings.max_calls_per_turn,
                loop_threshold=ctx.settings.loop_threshold,
            )
            kept, too_big = history_form(msg, ctx.settings.max_arguments_bytes)
            refused = {**too_big, **refused}
            self.state.update(round=round_no + 1, refused=refused, stop_after_round=stop)
            # The assistant message is durable before any of its calls is sent.
            pipe = ctx.store.redis.pipeline()
            pipe.rpush(k.history_key(ctx.turn_id), json.dumps(kept))
            pipe.hset(
                k.turn_key(ctx.turn_id),
                mapping={
                    "round": json.dumps(round_no + 1),
                    "refused": json.dumps(refused),
                    "stop_after_round": json.dumps(stop),
                    "call_count": json.dumps(len(earlier) + len(msg.tool_calls)),
                },
            )
            pipe.execute()
            if not msg.tool_calls:
                return "stop"


def _finish(ctx: TurnContext, state: dict[str, Any], reason: str) -> None:
    history = ctx.store.history(ctx.turn_id)
    final: dict[str, Any] = next((m for m in reversed(history) if m.get("role") == "assistant"), {})
    conv = state.get("conversation_id")
    if conv:
        pipe = ctx.store.redis.pipeline()
        pipe.delete(k.conversation_key(conv))
        pipe.rpush(k.conversation_key(conv), *[json.dumps(m) for m in history])
        pipe.execute()
    ctx.store.close(ctx.turn_id, "finished", finish_reason=reason, finished_at=time.time())
    ctx.publish(
        "turn_finished",
        reason=reason,
        content=final.get("content") or "",
        rounds=len([m for m in history if m.get("role") == "assistant"]),
    )


def _fail(ctx: TurnContext, code: str, message: str, **fields: Any) -> None:
    settle_pending(
        ctx.store,
        ctx.turn_id,
        lambda call, _: (
            denied_result(call, "policy")
            if code == "headless_interaction"
            else error_result(call, f"not run: the turn failed ({message})")
        ),
    )
    ctx.store.close(ctx.turn_id, "error", error=message, error_code=code)
    ctx.publish("turn_error", code=code, error=message, **fields)


def _state_lost(ctx: TurnContext) -> None:
    """Redis lost the turn (a restart without persistence): end it with a clear error.

    The record written here is terminal and expires like any finished turn, so nothing
    half-made lingers; results arriving later are refused (the store's open-turn check).
    """
    message = (
        "Redis lost this turn's state (restarted without persistence?); "
        "it cannot go on: start it again"
    )
    ctx.store.close(ctx.turn_id, "error", error=message, error_code="state_lost")
    ctx.publish("turn_error", code="state_lost", error=message)


def run_turn(turn_id: str, app: Celery | None = None) -> str:
    """Run (or resume) a turn until it finishes; safe to call twice: a live lease wins."""
    store = get_store()
    settings = get_settings()
    state = store.state(turn_id)
    if state is None:
        log.warning("turn %s: no state, nothing to run", turn_id)
        return "unknown"
    if state.get("status") in TERMINAL_STATUSES:
        return str(state["status"])
    holder = holder_id()
    if not store.acquire_lease(turn_id, holder, settings.turn_lease_s):
        return "busy"
    ctx = TurnContext(
        turn_id=turn_id,
        store=store,
        app=app or get_app(),
        settings=settings,
        headless=bool(state.get("headless")),
    )
    keeper = _lease_keeper()
    keeper.hold(ctx, holder)
    try:
        state = store.state(turn_id) or state
        if state.get("status") in TERMINAL_STATUSES:
            return str(state["status"])
        if state.get("status") == "queued":
            store.update(turn_id, status="running", started_at=time.time())
            ctx.publish(
                "turn_started", conversation_id=state.get("conversation_id"), headless=ctx.headless
            )
        else:
            ctx.publish("turn_resumed", worker=holder)
        try:
            reason = Turn(ctx, state).run()
        except Aborted as exc:
            if exc.reason == "lease lost":
                if store.status(turn_id) is None:
                    _state_lost(ctx)
                    return "error"
                return "lease lost"
            finalize_abort(
                store,
                ctx.app,
                turn_id,
                store.cancel_reason(turn_id) or exc.reason,
                kill_grace_s=settings.abort_kill_grace_s,
            )
            return "aborted"
        except HeadlessInteraction as exc:
            _fail(
                ctx,
                "headless_interaction",
                exc.message,
                request_id=exc.request_id,
                kind=exc.kind,
                exit_code=4,
            )
            return "error"
        except LlmError as exc:
            _fail(ctx, exc.code, exc.message, error_type=type(exc).__name__)
            return "error"
        _finish(ctx, state, reason)
        return "finished"
    except (redis.ConnectionError, redis.TimeoutError):
        # Redis stayed away longer than the client's retries: the state may well be
        # intact, so leave the turn to the reaper, which resumes it once Redis is back.
        log.exception("turn %s: Redis unreachable; leaving it to be resumed", turn_id)
        return "redis unreachable"
    except Exception as exc:
        log.exception("turn %s failed", turn_id)
        _fail(ctx, "internal", f"{type(exc).__name__}: {exc}")
        return "error"
    finally:
        keeper.drop(turn_id)


def register_turn_task(app: Celery) -> None:
    # A turn whose task fails on Redis before it is marked running would stay queued for
    # ever (the reaper resumes running turns only): Celery sends it again instead.
    @app.task(
        name=k.TASK_TURN,
        acks_late=True,
        ignore_result=True,
        queue=k.QUEUE_TURNS,
        autoretry_for=(redis.ConnectionError, redis.TimeoutError),
        retry_backoff=1,
        retry_backoff_max=30,
        max_retries=20,
    )
    def run_turn_task(turn_id: str) -> str:
        return run_turn(turn_id, app)
