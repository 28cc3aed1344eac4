"""The stream worker's task: one model round, streamed on the event loop and handed back
to the turn. The Celery thread only claims the round and hands it over, so one process
streams thousands; one thread renews their claims (`Streams`), which lapse with a dead
process, and the turn then sends its rounds again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from typing import Any

from celery import Celery

from agentq import constants as k
from agentq.aio.host import LoopHost, Running, get_host
from agentq.errors import (
    Aborted,
    AgentqError,
    LlmError,
    ModelBusy,
    ModelHTTPError,
)
from agentq.llm.apis import configured, names_responses
from agentq.llm.capacity import wake_granted
from agentq.llm.limits import CHARS_PER_TOKEN, DEFAULT_DEPLOYMENT
from agentq.llm.publisher import Publisher
from agentq.llm.responses import RESPONSES_PATH
from agentq.llm.streams import Streams, deployment_failure, get_streams
from agentq.models import AssistantMessage, LlmRoundRequest, LlmRoundResult, Usage
from agentq.state.budget import charged
from agentq.state.held import REDIS_AWAY
from agentq.state.rounds import LlmRoundStart, RoundBegun
from agentq.telemetry import logs, tracing

log = logging.getLogger("agentq.llm")


def warm() -> None:
    """At worker start, off the loop: the SDK import and the shared client."""
    # The SDK's HTTP client logs every request at INFO, each formatted on the loop.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    get_streams(get_host())


def _model(host: LoopHost, req: LlmRoundRequest) -> str:
    return req.model or host.settings.llm_model


def claim_round(host: LoopHost, req: LlmRoundRequest) -> LlmRoundStart | None:
    """In a Celery thread: claim the round and read its history; None when it is not
    this delivery's to stream (done, gone, or streaming elsewhere)."""
    streams = get_streams(host)
    started: dict[str, Any] = {"round_no": req.round_no, "model": _model(host, req)}
    if req.queued_s:
        started["queued_ms"] = int(req.queued_s * 1000)
    start = host.store.begin_llm_round(
        req.turn_id, req.round_no, streams.worker, streams.lease_ms, started
    )
    if start.outcome is RoundBegun.CLAIMED:
        # Renewed from the claim, not before it: a renewal of a round not yet claimed would
        # make the claim find it held "elsewhere"; not later: a busy loop may start it late.
        streams.hold((req.turn_id, req.round_no), req.lease_id)
        return start
    if start.outcome in (RoundBegun.GONE, RoundBegun.DONE) and req.lease_id:
        # Nobody will stream this round: its capacity grant goes back to the queue.
        wake_granted(host.store, streams.capacity.release(req.lease_id))
    if start.outcome is RoundBegun.GONE:
        log.info("round %s of turn %s: the turn is over or gone", req.round_no, req.turn_id)
    elif start.outcome is RoundBegun.ELSEWHERE:
        # The broker handed this round out again while another delivery streams it.
        log.warning("round %s of turn %s is streaming elsewhere", req.round_no, req.turn_id)
    return None


async def run_round(
    host: LoopHost, req: LlmRoundRequest, start: LlmRoundStart, task_id: str | None = None
) -> LlmRoundResult:
    """On the loop: stream a round `claim_round` claimed, and store its result."""
    streams = get_streams(host)
    model = _model(host, req)
    name = f"{k.TASK_LLM_ROUND}:{req.turn_id}:{req.round_no}"
    host.running[name] = Running(req.turn_id, f"model round {req.round_no} of turn {req.turn_id}")
    abort = asyncio.Event()
    remove_cancel = host.cancels.add(req.turn_id, abort.set)
    ids = logs.LogContext(req.turn_id, None, task_id)
    attrs = {tracing.ATTR_ROUND: req.round_no, "gen_ai.request.model": model}
    refused: AgentqError | None = None
    with tracing.observed(tracing.SPAN_ROUND, req.traceparent, ids, attrs) as span:
        try:
            if start.cancelled:
                abort.set()
            publisher = streams.publisher
            publisher.learned(req.turn_id, start.followed)
            rnd = _Round(host, req, publisher, model, len(streams.capacity.entry(model).routes) > 1)
            try:
                result = rnd.answered(*await rnd.call(streams, start.history, abort))
            except ModelBusy as exc:
                refused, result = exc, rnd.busy(exc)
            except Aborted:
                result = rnd.ended(aborted=True, error="aborted")
            except AgentqError as exc:
                refused, result = exc, rnd.failed(exc)
            except Exception as exc:
                result = rnd.crashed(exc)
            # Every delta is out, or in the write of the round's end, before the turn hears it.
            last = await publisher.take(req.turn_id)
            await host.io(streams.settle, req, model, result, refused, rnd.headers)
        finally:
            remove_cancel()
            streams.release((req.turn_id, req.round_no))
            host.running.pop(name, None)
    # Before the result is stored: storing it may run the turn's next step here.
    usage = result.message.usage if result.message is not None else None
    status = "ok" if result.ok else "aborted" if result.aborted else "error"
    tracing.end_span(
        span,
        status,
        {
            tracing.ATTR_TTFT_MS: rnd.ttft_ms,
            tracing.ATTR_INPUT_TOKENS: usage.prompt_tokens if usage else None,
            tracing.ATTR_OUTPUT_TOKENS: usage.completion_tokens if usage else None,
            "agentq.error_code": result.error_code,
            "gen_ai.response.finish_reasons": (
                [result.message.finish_reason]
                if result.message is not None and result.message.finish_reason
                else None
            ),
        },
        error=result.error,
    )
    await host.io(
        host.store.finish_llm_round, req.turn_id, req.round_no, result.model_dump_json(), last
    )
    return result


@dataclasses.dataclass
class _Round:
    """One round's streaming, its events and its result (see `run_round`)."""

    host: LoopHost
    req: LlmRoundRequest
    publisher: Publisher
    model: str
    failover: bool
    """Other deployments can take the round: a failing one gives it up at once."""
    t0: float = dataclasses.field(default_factory=time.monotonic)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    ttft_ms: int | None = None
    """From the round's start (retries included) to its first text, reasoning or tool call."""

    def emit(self, type_: str, **fields: Any) -> None:
        self.publisher.add(self.req.turn_id, type_, {"round_no": self.req.round_no, **fields})

    def elapsed_ms(self) -> int:
        return int((time.monotonic() - self.t0) * 1000)

    def _finished(self, **fields: Any) -> None:
        self.emit("llm_finished", model=self.model, duration_ms=self.elapsed_ms(), **fields)

    async def call(
        self, streams: Streams, history: list[dict[str, Any]], abort: asyncio.Event
    ) -> tuple[AssistantMessage, float]:
        """Stream the round from the model: its message and streaming seconds."""
        from agentq.llm.aclient import Attempt, astream_round, client_timeout

        req, settings = self.req, self.host.settings
        client, sent_model = streams.client_for(req.turn_id, self.model, req.deployment)
        if client is None:
            raise LlmError("AGENTQ_LLM_BASE_URL is not set: no model server to call")
        messages = history
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}, *messages]
        setting = configured(self.model, settings, streams.capacity.limits)
        if setting == "auto" and streams.apis.stale():
            await self.host.io(streams.apis.refresh)
        api = streams.apis.api_for(self.model, setting)

        first = Attempt(
            client=client,
            model=sent_model,
            idle_timeout_ms=req.idle_timeout_ms,
            duration_left_s=req.duration_left_s,
            max_retries=settings.llm_max_retries,
            # An agent with its own idle limit (or none) has its own read timeout.
            timeout=client_timeout(settings.llm_request_timeout_s, req.idle_timeout_ms),
            on_delta=lambda kind, text: self.emit("llm_delta", kind=kind, text=text),
            on_retry=self._on_retry,
            abort=abort,
            turn_id=req.turn_id,
            on_first_output=self._on_first_output,
            on_headers=self.headers.update,
            failover=self.failover,
            max_completion_tokens=req.max_completion_tokens,
            api=api,
            output_format=req.output_format,
        )
        try:
            return await astream_round(first, messages, req.tools_json)
        except ModelHTTPError as exc:
            moves = setting == "auto" and api == "chat" and names_responses(exc)
            if not moves or streams.apis.kept_on_chat(self.model):
                raise
            refused = exc
        # The server wants the Responses API: the model moves there fleet-wide, and this
        # round, which said nothing on chat, goes again at once.
        await self.host.io(streams.apis.learn, self.model, "responses", refused.message)
        try:
            again = dataclasses.replace(first, api="responses")
            return await astream_round(again, messages, req.tools_json)
        except ModelHTTPError as exc:
            if exc.status_code != 404:
                raise
            reason = f"{RESPONSES_PATH} answered 404 ({exc.message}); {refused.message}"
            await self.host.io(streams.apis.learn, self.model, "chat", reason)
            raise refused from exc

    def _usage(self, message: AssistantMessage) -> Usage:
        """The round's usage as the server counted it, else estimated; priced."""
        chars = len(message.content) + len(message.reasoning)
        chars += sum(len(c.name) + len(c.arguments) for c in message.tool_calls)
        completion, price = math.ceil(chars / CHARS_PER_TOKEN), self.host.settings.llm_prices
        return charged(message.usage, self.req.prompt_estimate, completion, price.get(self.model))

    def _on_retry(self, attempt: int, exc: Exception, delay_s: float) -> None:
        code = getattr(exc, "code", None)
        delay_ms = int(delay_s * 1000)
        self.emit("llm_retry", attempt=attempt, error=str(exc), code=code, delay_ms=delay_ms)

    def _on_first_output(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = self.elapsed_ms()

    def answered(self, message: AssistantMessage, streamed_s: float) -> LlmRoundResult:
        usage = self._usage(message)
        message = message.model_copy(update={"usage": usage})
        self._finished(
            finish_reason=message.finish_reason,
            tool_calls=len(message.tool_calls),
            usage=usage.model_dump(exclude_none=True),
            key=self.req.key,
            ttft_ms=self.ttft_ms,
        )
        return LlmRoundResult(ok=True, message=message, streamed_s=streamed_s)

    def busy(self, exc: ModelBusy) -> LlmRoundResult:
        """Not this round's failure: the turn queues it again, with no retry used."""
        self._finished(
            error=exc.message,
            code=exc.code,
            status=exc.status_code,
            deployment=self.req.deployment or DEFAULT_DEPLOYMENT,
        )
        return self.ended(error=exc.message, error_code=exc.code, error_type=type(exc).__name__)

    def failed(self, exc: AgentqError) -> LlmRoundResult:
        code = getattr(exc, "code", "ELLM")
        fields = {k_: v for k_, v in vars(exc).items() if isinstance(v, (int, float, str))}
        self._finished(
            error=exc.message,
            code=code,
            ttft_ms=self.ttft_ms,
            **{f"error_{k_}": v for k_, v in fields.items() if k_ != "message"},
        )
        # Before the model said anything, another deployment may take the round.
        failover = self.failover and self.ttft_ms is None and bool(deployment_failure(exc))
        return self.ended(
            error=exc.message, error_code=code, error_type=type(exc).__name__, failover=failover
        )

    def crashed(self, exc: Exception) -> LlmRoundResult:
        log.exception("model round failed")
        error = f"{type(exc).__name__}: {exc}"
        return self.ended(error=error, error_code="ELLM", error_type=type(exc).__name__)

    def ended(self, **fields: Any) -> LlmRoundResult:
        return LlmRoundResult(ok=False, streamed_s=time.monotonic() - self.t0, **fields)


def submit_round(req: LlmRoundRequest, task_id: str | None = None) -> None:
    """In a Celery thread: claim the round (a blocking Redis call the loop cannot afford),
    then hand it to the loop, waiting while the loop is full."""
    host = get_host()
    try:
        start = claim_round(host, req)
    except Exception as exc:
        log.exception("round %s of turn %s could not be claimed", req.round_no, req.turn_id)
        if not isinstance(exc, REDIS_AWAY):  # else unclaimed: the turn's pickup resends it
            _fail_round(host, req)
        return
    if start is None:
        return
    try:
        host.loop.submit(lambda: _guarded(host, req, start, task_id))
    except BaseException:
        # Not on the loop after all: stop renewing the claim, and say so to the turn.
        get_streams(host).release((req.turn_id, req.round_no))
        _fail_round(host, req)
        raise


def _fail_round(host: LoopHost, req: LlmRoundRequest) -> None:
    """Tell the turn now, rather than after its pick-up wait, that this round failed here."""
    with contextlib.suppress(Exception):
        failed = LlmRoundResult(ok=False, error="the stream worker failed", error_code="ELLM")
        host.store.finish_llm_round(req.turn_id, req.round_no, failed.model_dump_json())


async def _guarded(
    host: LoopHost, req: LlmRoundRequest, start: LlmRoundStart, task_id: str | None = None
) -> None:
    try:
        await run_round(host, req, start, task_id)
    except Exception:
        log.exception("round %s of turn %s failed outside the stream", req.round_no, req.turn_id)
        with contextlib.suppress(Exception):
            await host.io(_fail_round, host, req)


def register_llm_task(app: Celery) -> None:
    @app.task(
        name=k.TASK_LLM_ROUND, bind=True, acks_late=True, ignore_result=True, queue=k.QUEUE_LLM
    )
    def llm_round_task(self: Any, **kwargs: object) -> None:
        submit_round(LlmRoundRequest.model_validate(kwargs), getattr(self.request, "id", None))
