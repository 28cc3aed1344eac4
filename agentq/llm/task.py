"""The stream worker's task: one model round, streamed, watched, and handed back to the turn."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

from celery import Celery

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import Aborted, AgentqError, LlmError
from agentq.llm.client import stream_round
from agentq.models import LlmRoundRequest, LlmRoundResult
from agentq.runtime import get_store
from agentq.store import TurnStore

log = logging.getLogger("agentq.llm")


def run_round(req: LlmRoundRequest) -> LlmRoundResult:
    settings = get_settings()
    store = get_store()
    done = store.redis.get(k.llm_result_key(req.turn_id, req.round_no))
    if done is not None:
        return LlmRoundResult.model_validate_json(done)
    if store.status(req.turn_id) in (None, "finished", "aborted", "error"):
        # A late or redelivered round of a turn that ended (or that Redis lost).
        return LlmRoundResult(ok=False, error="the turn is over or gone", error_code="EGONE")
    # A heartbeat the turn watches: if this process dies mid-stream, the key lapses
    # and the turn sends the round again instead of waiting for its long deadline.
    alive = k.llm_alive_key(req.turn_id, req.round_no)
    lease_ms = int(settings.turn_lease_s * 1000)
    if not store.redis.set(alive, "1", nx=True, px=lease_ms):
        # The broker handed this round out again while another delivery streams it.
        log.warning("round %s of turn %s is streaming elsewhere", req.round_no, req.turn_id)
        return LlmRoundResult(ok=False, error="streaming elsewhere", error_code="EDUPLICATE")
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(settings.turn_lease_s / 3):
            try:
                store.redis.set(alive, "1", px=lease_ms)
            except Exception:
                log.warning("llm heartbeat failed", exc_info=True)

    heart = threading.Thread(target=beat, name="agentq-llm-heartbeat", daemon=True)
    heart.start()
    try:
        return _run_round(req, store, settings)
    finally:
        beating.set()
        heart.join()
        with contextlib.suppress(Exception):  # it lapses on its own; never mask the round
            store.redis.delete(alive)


def _run_round(req: LlmRoundRequest, store: TurnStore, settings: Settings) -> LlmRoundResult:
    cancel = k.cancel_key(req.turn_id)

    def cancelled() -> bool:
        return bool(store.redis.exists(cancel))

    def on_delta(kind: str, text: str) -> None:
        store.bus.publish(req.turn_id, "llm_delta", round_no=req.round_no, kind=kind, text=text)

    def on_retry(attempt: int, exc: Exception, delay_s: float) -> None:
        store.bus.publish(
            req.turn_id,
            "llm_retry",
            round_no=req.round_no,
            attempt=attempt,
            error=str(exc),
            code=getattr(exc, "code", None),
            delay_ms=int(delay_s * 1000),
        )

    store.bus.publish(req.turn_id, "llm_started", round_no=req.round_no, model=settings.llm_model)
    t0 = time.monotonic()
    try:
        if not settings.llm_base_url:
            raise LlmError("AGENTQ_LLM_BASE_URL is not set: no model server to call")
        messages = store.history(req.turn_id)
        message, streamed_s = stream_round(
            messages,
            req.tools,
            base_url=settings.llm_base_url,
            api_key=settings.llm_api_key,
            model=settings.llm_model,
            idle_timeout_ms=req.idle_timeout_ms,
            duration_left_s=req.duration_left_s,
            max_retries=settings.llm_max_retries,
            request_timeout_s=settings.llm_request_timeout_s,
            on_delta=on_delta,
            on_retry=on_retry,
            cancelled=cancelled,
            turn_id=req.turn_id,
        )
        result = LlmRoundResult(ok=True, message=message, streamed_s=streamed_s)
        store.bus.publish(
            req.turn_id,
            "llm_finished",
            round_no=req.round_no,
            finish_reason=message.finish_reason,
            tool_calls=len(message.tool_calls),
            usage=None if message.usage is None else message.usage.model_dump(),
            duration_ms=int((time.monotonic() - t0) * 1000),
        )
    except Aborted:
        result = LlmRoundResult(
            ok=False, aborted=True, error="aborted", streamed_s=time.monotonic() - t0
        )
    except AgentqError as exc:
        code = getattr(exc, "code", "ELLM")
        fields = {k_: v for k_, v in vars(exc).items() if isinstance(v, (int, float, str))}
        store.bus.publish(
            req.turn_id,
            "llm_finished",
            round_no=req.round_no,
            error=exc.message,
            code=code,
            duration_ms=int((time.monotonic() - t0) * 1000),
            **{f"error_{k_}": v for k_, v in fields.items() if k_ != "message"},
        )
        result = LlmRoundResult(
            ok=False,
            error=exc.message,
            error_code=code,
            error_type=type(exc).__name__,
            streamed_s=time.monotonic() - t0,
        )
    except Exception as exc:
        log.exception("model round failed")
        result = LlmRoundResult(
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            error_code="ELLM",
            error_type=type(exc).__name__,
            streamed_s=time.monotonic() - t0,
        )
    payload = result.model_dump_json()
    pipe = store.redis.pipeline()
    pipe.set(k.llm_result_key(req.turn_id, req.round_no), payload, ex=settings.state_ttl_s)
    pipe.rpush(
        k.inbox_key(req.turn_id),
        f'{{"kind":"llm","round_no":{req.round_no},"result":{payload}}}',
    )
    pipe.execute()
    return result


def register_llm_task(app: Celery) -> None:
    @app.task(name=k.TASK_LLM_ROUND, acks_late=True, ignore_result=True, queue=k.QUEUE_LLM)
    def llm_round_task(**kwargs: object) -> str:
        result = run_round(LlmRoundRequest.model_validate(kwargs))
        return "ok" if result.ok else json.dumps({"error": result.error})
