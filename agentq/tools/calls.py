"""One tool call's life as both tool workers share it: start, ToolContext, result, settle."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import AgentqError, ToolMisuse
from agentq.fleet import roles
from agentq.models import ToolCall, ToolResult, ToolTaskRequest
from agentq.state.calls import Started
from agentq.state.held import REDIS_AWAY, held_writes
from agentq.telemetry import logs, tracing
from agentq.tools.context import Partial, ToolContext, Waitpoint
from agentq.tools.policy import overran, truncate_text
from agentq.tools.registry import ToolSpec
from agentq.tools.results import cancelled_result, error_result, ok_result, timeout_result
from agentq.webhooks.task import queue_waiting

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.tools")


@dataclass
class CallScope:
    """What every result of one call carries, fixed when the call starts, and how it ran."""

    req: ToolTaskRequest
    worker: str
    task_id: str | None
    started: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    soft_fired: bool = False
    """The call's soft limit fired during it (the pool's signal, or the I/O worker's timer)."""
    done: bool = False
    """The tool returned: a signal now would drop its result, held while Redis is away."""

    @property
    def call(self) -> ToolCall:
        return ToolCall(id=self.req.call_id, name=self.req.tool, arguments="")

    @property
    def common(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "worker": self.worker,
            "pid": self.pid,
            "attempt": self.req.attempt,
            "budget_s": self.req.budget_s,
            "timeout_s": self.req.timeout_s,
            "started_at": self.started,
        }

    def cancelled(self) -> ToolResult:
        return cancelled_result(self.call, "user", **self.common)

    def timeout(self, *, killed: bool, soft: bool = False, what: str | None = None) -> ToolResult:
        return timeout_result(self.call, killed=killed, soft=soft, what=what, **self.common)


def task_scope(request: Any, req: ToolTaskRequest) -> tuple[CallScope, str]:
    """The call's scope and its delivery (`task_id/retries`) from its Celery task's request."""
    task_id = getattr(request, "id", None)
    scope = CallScope(req, getattr(request, "hostname", None) or "local", task_id)
    return scope, f"{task_id}/{getattr(request, 'retries', 0) or 0}"


def observed(
    scope: CallScope, ends: type[BaseException] = BaseException
) -> contextlib.AbstractContextManager[Any]:
    """`tracing.observed` for the call: tools' own spans nest under its span."""
    req = scope.req
    ids = logs.LogContext(req.turn_id, req.call_id, scope.task_id)
    attrs = tracing.call_attributes(req.turn_id, req.call_id, req.tool, scope.task_id, req.attempt)
    return tracing.observed(tracing.CALL_SPAN_PREFIX + req.tool, req.traceparent, ids, attrs, ends)


HOLD_PAST_DEADLINE_S = 60.0
"""A held result keeps trying this long past its call's lost-deadline: the turn cannot settle
it `lost` while Redis is away either, and the first writer wins when it returns."""
HOLD_START_S = 60.0
"""How long a start waits for Redis, at most half the hard limit (which counts the wait),
before the delivery is given up: the turn sends a call that never started again."""
HOLD_NO_LIMIT_S = 600.0
"""How long the result of a call without a hard limit waits for Redis."""


def start_deadline(timeout_s: float, now: float) -> float:
    """Until when a start waits for Redis: HOLD_START_S, at most half the hard limit."""
    return now + (min(HOLD_START_S, timeout_s / 2) if timeout_s > 0 else HOLD_START_S)


@dataclass(frozen=True)
class Waiting:
    """A run that ended with a Waitpoint: a wait `settle` records, settled later."""

    waitpoint: Waitpoint
    status: str = "waiting"


def waiting(scope: CallScope, wp: Waitpoint, settings: Settings) -> Waiting:
    """The call's wait, once its Waitpoint is checked (ToolMisuse when it is not valid)."""
    timeout_s = wp.timeout_s
    ceiling_s = settings.waitpoint_max_timeout_s
    finite = isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf
    if not finite or timeout_s > ceiling_s:
        raise ToolMisuse(
            scope.req.tool,
            f"it returned a Waitpoint with timeout_s={timeout_s!r}; a waitpoint needs a "
            f"finite timeout_s in seconds, > 0 and at most {ceiling_s:g} "
            "(AGENTQ_WAITPOINT_MAX_TIMEOUT_S)",
        )
    try:
        json.dumps({"data": wp.data, "key": wp.idempotency_key, "tags": list(wp.tags)})
    except (TypeError, ValueError) as exc:
        raise ToolMisuse(
            scope.req.tool, f"its Waitpoint's data, idempotency_key and tags must be JSON ({exc})"
        ) from None
    return Waiting(wp)


def settle(store: TurnStore, scope: CallScope, result: ToolResult | Waiting) -> None:
    """Settle the call, or record its waitpoint, waiting while Redis is away: first writer
    wins, so a write sent again, or one the turn's `lost` beat, changes nothing."""
    req = scope.req
    if req.timeout_s <= 0:
        until = time.time() + HOLD_NO_LIMIT_S
    else:
        until = scope.started + req.timeout_s + get_settings().tool_grace_s + HOLD_PAST_DEADLINE_S
    if not isinstance(result, Waiting):
        if result.status != "ok":
            result.record.overran = overran(time.time() - scope.started, req.budget_s)
        what = f"the result of call {req.call_id} ({req.tool})"
        held_writes.hold(lambda: store.settle(req.turn_id, result), until, what)
        return
    wp = result.waitpoint
    wp_id, _, url = store.waitpoint_address(req.turn_id, req.call_id)
    now = time.time()
    given = {"data": wp.data, "idempotency_key": wp.idempotency_key, "tags": list(wp.tags)}
    record = {
        "id": wp_id,
        "tool": req.tool,
        "opened_at": now,
        "started_at": scope.started,
        "deadline_ms": int((now + wp.timeout_s) * 1000),
        "timeout_s": wp.timeout_s,
        "task_id": scope.task_id,
        "worker": scope.worker,
        **given,
    }
    event = {
        "call_id": req.call_id,
        "tool": req.tool,
        "waitpoint_id": wp_id,
        "timeout_s": wp.timeout_s,
        "callback_url": url,
        **given,
    }
    opened = held_writes.hold(
        lambda: store.open_waitpoint(req.turn_id, req.call_id, record, event),
        until,
        f"the waitpoint of call {req.call_id} ({req.tool})",
    )
    if opened:
        try:
            queue_waiting(store, get_settings(), req.turn_id, event)
        except Exception:
            # The wait is recorded and published: its webhook is a courtesy on top.
            log.warning("turn.waiting webhook of call %s not queued", req.call_id, exc_info=True)


def mark_started(
    store: TurnStore, scope: CallScope, delivery: str, *, within_limit: bool = False
) -> str | None:
    """Record the start; None when the call should run, else why it does not (for Flower).
    `within_limit` (the I/O worker, whose clock is `scope.started`) waits for Redis up to the
    whole hard limit: a start given up may have been applied all the same, and the call then
    settled `lost` though it never ran (a 20 s outage did)."""
    req = scope.req
    start = {
        "started_at": scope.started,
        "worker": scope.worker,
        "pid": scope.pid,
        "task_id": scope.task_id,
        "attempt": req.attempt,
        "delivery": delivery,
        # A call run elsewhere (eagerly, in a test) has no beats, and is not dead for that.
        "heartbeat": roles.role in roles.HEARTBEAT_ROLES,
        # This attempt's own: the same START sent again finds it (see START_LUA).
        "claim": secrets.token_hex(8),
    }
    event = {"call_id": req.call_id, "tool": req.tool, "timeout_s": req.timeout_s}
    event |= {k: start[k] for k in ("worker", "pid", "attempt")}
    claim = held_writes.hold(
        lambda: store.mark_started(req.turn_id, req.call_id, start, event),
        (
            scope.started + (req.timeout_s if req.timeout_s > 0 else HOLD_START_S)
            if within_limit
            else start_deadline(req.timeout_s, time.time())
        ),
        f"the start of call {req.call_id} ({req.tool})",
    )
    if claim is Started.CANCELLED:
        settle(store, scope, scope.cancelled())
    return _NOT_RUN.get(claim)


_NOT_RUN = {
    Started.SETTLED: "already settled: not run again",
    Started.REDELIVERED: "delivered again while its first delivery ran: not run again",
    Started.TURN_GONE: "its turn is over or gone: not run",
    Started.CANCELLED: "turn cancelled before start",
}


FLOWER_PROGRESS_S = 0.5
"""A call's progress reaches Flower at most this often, and only once it has run this long:
most calls end sooner, and Flower is for watching the long ones."""


def sent(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> bool:
    """A progress write: advisory, so a failed one never fails the tool that reports it."""
    try:
        fn(*args, **kwargs)
    except REDIS_AWAY:
        log.warning("progress not sent: Redis is away", exc_info=True)
        return False
    except Exception:
        log.debug("progress not sent", exc_info=True)
        return False
    return True


Send = Callable[..., object]


def tool_context(
    store: TurnStore, scope: CallScope, backend: Any, send: Send, *, watched: bool = False
) -> ToolContext:
    """The call's ToolContext; `send(sent, fn, *args)` runs a progress write (the I/O worker's
    off its loop), and if `watched` the I/O worker's cancel channel sets its `_cancelled`."""
    req = scope.req
    flower_at = time.monotonic()

    def cancelled() -> bool:
        return bool(store.redis.exists(k.turn_key(req.turn_id, "cancel")))

    def read_secret() -> str | None:
        if not req.secret_ref:
            return None
        raw = store.redis.getdel(req.secret_ref)
        return None if raw is None else raw.decode()  # type: ignore[union-attr]

    def progress(message: str, pct: float | None, fields: dict[str, Any]) -> None:
        nonlocal flower_at
        meta = progress_fields(scope, {"message": message, "pct": pct, "source": "tool", **fields})
        if send(sent, store.bus.publish, req.turn_id, "tool_progress", **meta) is False:
            return
        now = time.monotonic()
        if scope.task_id and backend is not None and now - flower_at >= FLOWER_PROGRESS_S:
            flower_at = now
            send(sent, backend.store_result, scope.task_id, meta, "PROGRESS")

    return ToolContext(
        turn_id=req.turn_id,
        call_id=req.call_id,
        tool=req.tool,
        started_at=scope.started,
        timeout_s=req.timeout_s,
        soft_timeout_s=req.soft_timeout_s,
        is_cancelled=None if watched else cancelled,
        on_progress=progress,
        read_secret=read_secret,
        attempt=req.attempt,
        locate_waitpoint=lambda: store.waitpoint_address(req.turn_id, req.call_id),
    )


def progress_fields(scope: CallScope, fields: dict[str, Any]) -> dict[str, Any]:
    req = scope.req
    elapsed_ms = int((time.time() - scope.started) * 1000)
    return {"call_id": req.call_id, "tool": req.tool, "elapsed_ms": elapsed_ms, **fields}


def tick(store: TurnStore, scope: CallScope) -> None:
    """The worker's own progress for its call, every few seconds: a lost one is no warning."""
    fields = progress_fields(scope, {"state": "running", "source": "worker"})
    try:
        store.bus.publish(scope.req.turn_id, "tool_progress", **fields)
    except Exception:
        log.debug("progress tick not sent", exc_info=True)


def invoke(spec: ToolSpec, ctx: ToolContext, req: ToolTaskRequest) -> Any:
    """Call the tool with the validated arguments (ToolArgumentsInvalid), ctx first if wanted."""
    # A model's fields, then the extra ones it keeps (an MCP tool's, checked by its JSON schema).
    kwargs = dict(spec.validate(req.arguments))
    return spec.fn(ctx, **kwargs) if spec.wants_ctx else spec.fn(**kwargs)


def returned(
    scope: CallScope, spec: ToolSpec, value: Any, settings: Settings
) -> ToolResult | Waiting:
    """What the tool returned; ToolMisuse, saying what to change, for what no tool may return."""
    misuse = None
    if inspect.iscoroutine(value) or inspect.isgenerator(value):
        value.close()  # never run on purpose: no RuntimeWarning about it
    if inspect.iscoroutine(value):
        misuse = "a coroutine; declare it `async def` so `agentq worker io` awaits it"
    elif inspect.isawaitable(value):
        misuse = f"an awaitable ({type(value).__name__}); declare it `async def`, await it inside"
    elif inspect.isgenerator(value) or inspect.isasyncgen(value):
        misuse = "a generator; return a list of the items instead"
    if misuse is not None:
        raise ToolMisuse(spec.name, f"it returned {misuse}")
    if isinstance(value, Waitpoint):
        return waiting(scope, value, settings)
    finished = time.time()
    req = scope.req
    partial = isinstance(value, Partial)
    if partial:
        value = value.value
    soft = scope.soft_fired or 0 < (req.soft_timeout_s or 0) <= finished - scope.started
    if isinstance(value, BaseModel):
        value = value.model_dump_json()
    elif not isinstance(value, str):
        value = json.dumps(value, default=str, ensure_ascii=False)
    text, cut = truncate_text(value, settings.max_result_bytes)
    return ok_result(
        scope.call,
        text,
        cut,
        finished_at=finished,
        soft_limited=soft,
        partial=partial or soft,
        overran=overran(finished - scope.started, req.budget_s),
        **scope.common,
    )


def outcome(
    scope: CallScope,
    spec: ToolSpec,
    settings: Settings,
    *,
    aborted: bool = False,
    hard_limit: str | None = None,
    raised: BaseException | None = None,
    value: Any = None,
) -> ToolResult | Waiting:
    """The call's result by one precedence: an abort the tool saw (the abort step's status
    too), the hard limit (`hard_limit`: what it did), the soft limit once the tool raised,
    its error, its value."""
    if aborted:
        return scope.cancelled()
    if hard_limit is not None:
        return scope.timeout(killed=True, what=hard_limit)
    if raised is not None and scope.soft_fired:
        return scope.timeout(killed=False, soft=True)
    if raised is None:
        try:
            return returned(scope, spec, value, settings)
        except Exception as exc:  # a value no tool may return (ToolMisuse)
            raised = exc
    if isinstance(raised, AgentqError):
        return error_result(scope.call, raised.message, **scope.common)
    what = f"{scope.req.tool} raised {type(raised).__name__}: {raised}"
    return error_result(scope.call, what, **scope.common)
