"""Steps: the short `agentq.turn.step` tasks that advance turns (inline in the process that
woke the turn, or on a turn worker), and the sweeper that wakes turns whose deadline came or
whose worker died. The step lock and a dying step's take-over: docs/turns.md."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import redis

from agentq import constants as k
from agentq.agents import all_agents, publish_agents
from agentq.config import Settings, get_settings
from agentq.errors import (
    BrokerUnavailable,
    BudgetExceeded,
    HeadlessInteraction,
    LlmError,
    StepLost,
)
from agentq.fleet import runtime
from agentq.fleet.broker import BROKER_RETRY_S, broadcast
from agentq.models import TERMINAL_STATUSES
from agentq.orchestrator.context import StepContext
from agentq.orchestrator.conversation import hand_off
from agentq.orchestrator.machine import advance, fail
from agentq.orchestrator.wake import send_step_or_wake
from agentq.state.base import StepView, text
from agentq.state.listing import TurnLister
from agentq.state.steplock import Released
from agentq.state.store import TurnStore
from agentq.telemetry import logs, tracing
from agentq.telemetry.fleetcounts import fleet_counts
from agentq.webhooks.task import queue_delivery

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("agentq.turn")

StepOutcome = Literal["busy", "unknown", "lost", "ended", "waiting"]
"""How a step task ended (its span's `agentq.step_outcome`): another step holds the turn, no
such turn, its lock lost to another step, it ended the turn, it let go of a waiting turn."""

PRUNE_EVERY_S = 60.0
DUE_PER_PASS = 500
"""Due wakeups a pass takes of each shard; a pass that took that many sweeps again at once."""
MIN_SWEEP_WAIT_S = 0.02
"""The shortest wait between two sweeps: wakeups due closer together go in one pass."""
PRUNE_ROUNDS = 10
PRUNE_BATCH = 500


def run_step(turn_id: str, *, store: TurnStore, app: Celery, settings: Settings) -> StepOutcome:
    """Advance one turn as far as it goes now; "busy" if another step holds it."""
    token = secrets.token_hex(8)
    ttl_ms = int(settings.step_lock_s * 1000)
    view = store.begin_step(turn_id, token, ttl_ms)
    if view is None:
        return "busy"
    return take_step(turn_id, view, token, ttl_ms, store=store, app=app, settings=settings)


def take_step(
    turn_id: str,
    view: StepView,
    token: str,
    ttl_ms: int,
    *,
    store: TurnStore,
    app: Celery,
    settings: Settings,
) -> StepOutcome:
    """`run_step` for a step whose lock and view are taken (by the write that woke it)."""
    started = time.perf_counter()
    try:
        if not (tracing.enabled or logs.enabled):
            return _steps(turn_id, view, token, ttl_ms, store, app, settings)
        state = view.state or {}
        ids, task_id = logs.LogContext(turn_id), logs.celery_task()[0]
        attrs = {tracing.ATTR_AGENT: state.get("agent"), tracing.ATTR_TASK_ID: task_id}
        with tracing.observed(tracing.SPAN_STEP, state.get("traceparent"), ids, attrs) as span:
            outcome = _steps(turn_id, view, token, ttl_ms, store, app, settings)
        tracing.end_span(span, None, {"agentq.step_outcome": outcome})
        return outcome
    finally:
        fleet_counts.step(time.perf_counter() - started, store.redis, settings.metrics_flush_s)


def _steps(
    turn_id: str,
    view: StepView,
    token: str,
    ttl_ms: int,
    store: TurnStore,
    app: Celery,
    settings: Settings,
) -> StepOutcome:
    while True:
        if view.state is None:
            store.release_step(turn_id, token, None, ttl_ms)
            return "unknown"
        agent = all_agents().get(str(view.state.get("agent") or ""))
        ctx = StepContext(
            turn_id,
            store,
            app,
            settings if agent is None else agent.settings_for(settings),
            token,
            view.state,
            history=view.history,
            cancel_reason=view.cancel_reason,
            agent=agent,
            round_read=view.round,
            lock_ms=ttl_ms,
        )
        try:
            next_at = _advance(ctx)
        except StepLost:
            log.warning("turn %s: step lost its lock to another step", turn_id)
            return "lost"
        except BrokerUnavailable as exc:
            # What was not sent is recorded as not sent; the wakeup tries again.
            log.warning("turn %s: %s; trying again in %g s", turn_id, exc, BROKER_RETRY_S)
            next_at = time.time() + BROKER_RETRY_S
        if ctx.ended is not None:
            tracing.end_turn(
                ctx.state.get("traceparent"),
                ctx.state.get("trace_caller"),
                {
                    tracing.ATTR_TURN_ID: turn_id,
                    tracing.ATTR_AGENT: ctx.state.get("agent"),
                    "agentq.rounds": ctx.state.get("round"),
                    "agentq.call_count": ctx.state.get("call_count"),
                    "agentq.parent_turn_id": ctx.state.get("parent_turn_id"),
                },
                created_at=ctx.state.get("created_at"),
                status=str(ctx.ended),
                error=ctx.state.get("error"),
            )
        if ctx.state.get("status") in TERMINAL_STATUSES:
            _after_end(ctx)
        if ctx.ended is not None:
            return "ended"  # the write that ended the turn let go of the lock
        if ctx.released is None:  # else it let go before its last act
            try:
                ctx.release(next_at)
            except StepLost:
                return "lost"
        if ctx.released is Released.RELEASED:
            return "waiting"
        # Woken while it ran: read the turn again and go on, the lock kept.
        again = store.begin_step(turn_id, token, ttl_ms, again=True)
        if again is None:
            return "lost"
        view = again


def _advance(ctx: StepContext) -> float | None:
    try:
        return advance(ctx)
    except HeadlessInteraction as exc:
        where = {"request_id": exc.request_id, "kind": exc.kind}
        fail(ctx, "headless_interaction", exc.message, **where, exit_code=4)
    except BudgetExceeded as exc:
        # Before a round: every call of the last one has its result, the history is whole.
        fields = ("scope", "budget", "spent", "limit", "resets_at")
        fail(ctx, exc.code, exc.message, **{f: getattr(exc, f) for f in fields})
    except LlmError as exc:
        fail(ctx, exc.code, exc.message, error_type=type(exc).__name__)
    except (StepLost, BrokerUnavailable, redis.ConnectionError, redis.TimeoutError):
        # Redis stayed away past the client's retries: the state is intact, the sweep retries.
        raise
    except Exception as exc:
        log.exception("turn %s: step failed", ctx.turn_id)
        fail(ctx, "internal", f"{type(exc).__name__}: {exc}")
    return None


def _after_end(ctx: StepContext) -> None:
    """Queue the webhook's delivery and hand the conversation on, after the end is written,
    by its step or by one that died before it did (whose end left the backstop that woke
    this one; done already, this changes nothing); either takes the backstop away."""
    url = ctx.state.get("webhook_url")
    if url:
        queue_delivery(ctx.store, ctx.app, ctx.settings, ctx.turn_id, url)
    if ctx.state.get("conversation_id"):
        hand_off(ctx.store, ctx.app, ctx.turn_id, ctx.state, ctx.history)
    if url:
        ctx.store.redis.zrem(k.shard_key(k.WAKEUPS, ctx.turn_id), ctx.turn_id)


class Sweeper:
    """Wakes due turns and those of dead workers; one per turn worker, each claim taken once."""

    def __init__(self, store: TurnStore, app: Celery, settings: Settings) -> None:
        self.store = store
        self.app = app
        self.interval_s = settings.sweep_interval_s
        # A claimed wakeup comes due again after this: the retry when its step died.
        self.retry_s = settings.step_lock_s + 5.0
        self.retention_s = settings.turn_retention_s
        self._next_prune = 0.0

    def start(self) -> None:
        threading.Thread(target=self._run, name="agentq-sweeper", daemon=True).start()

    def look(self, now: float) -> Look:
        """What a pass at `now` has to do, in one round trip."""
        pipe = self.store.redis.pipeline(transaction=False)
        for key in [*(k.shard_key(k.WAKEUPS, shard) for shard in k.shards()), k.KILLS]:
            pipe.zrangebyscore(key, "-inf", now, start=0, num=DUE_PER_PASS)
            pipe.zrangebyscore(key, f"({now!r}", "+inf", start=0, num=1, withscores=True)
        pipe.zrangebyscore(k.WORKERS, "-inf", now - k.WORKER_ALIVE_TTL_S)
        *found, dead = pipe.execute()
        *due, kills = found[0::2]
        soonest = [float(score) for rows in found[1::2] for _, score in rows]
        if any(len(rows) >= DUE_PER_PASS for rows in found[0::2]):
            soonest.append(now)  # the rest of a backlog: sweep again at once
        return Look(
            wakeups=[text(t) for rows in due for t in rows],
            kills=kills,
            dead=[text(w) for w in dead],
            next_at=min(soonest, default=None),
        )

    def sweep(self, now: float | None = None) -> Look:
        """One pass; returns what it found (`next_at`: when the next pass is due)."""
        now = time.time() if now is None else now
        look = self.look(now)
        for turn_id in look.wakeups:
            claimed = self.store.claim_wakeup(turn_id, now, self.retry_s)
            if claimed and not send_step_or_wake(self.store, self.app, turn_id):
                break  # the rest wait too: each would spend kombu's retries on the same outage
        r = self.store.redis
        send_kills(r, self.app, look.kills)
        for host in look.dead:
            if not r.zrem(k.WORKERS, host):
                continue  # another sweeper took it
            # Their steps settle the dead worker's running calls as lost.
            turns = self.store.turns_running_on(host)
            log.warning("worker %s stopped beating; waking %d turns of its calls", host, len(turns))
            for turn_id in turns:
                self.store.wake(turn_id)
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            self.prune_index(now)
            # Kept fresh, so agents no worker runs any more drop out of the known ones.
            publish_agents(r, now)
        return look

    def prune_index(self, now: float) -> int:
        """Drop the console index's entries of turns whose retention ran out."""
        return TurnLister(self.store.redis).prune(now - self.retention_s, PRUNE_BATCH, PRUNE_ROUNDS)

    def until_next_s(self, now: float, next_at: float | None) -> float:
        """The wait before the next pass: the interval, or less when a wakeup is due sooner
        (a queued round's slot, mostly, which may pass unused if asked for late)."""
        if next_at is None:
            return self.interval_s
        return min(self.interval_s, max(next_at - now, MIN_SWEEP_WAIT_S))

    def _run(self) -> None:
        wait_s = self.interval_s
        while True:
            time.sleep(wait_s)
            wait_s = self.interval_s
            try:
                wait_s = self.until_next_s(time.time(), self.sweep().next_at)
            except Exception:
                log.warning("wakeup sweep failed", exc_info=True)


class Look(NamedTuple):
    """What one sweep found due (turns, `KILLS` members, dead workers), and when the next is."""

    wakeups: list[str]
    kills: list[bytes]
    dead: list[str]
    next_at: float | None
    """The soonest wakeup or escalation not yet due (None: nothing waits)."""


def send_kills(r: redis.Redis, app: Celery, due: list[bytes]) -> int:
    """Send due escalations (`agentq_kill`), each by the sweeper whose ZREM takes it; how many."""
    sent = 0
    for raw in due:
        if r.zrem(k.KILLS, raw):
            order = json.loads(raw)
            broadcast(app, k.KILL_COMMAND, {"targets": order["targets"]}, destination=order["to"])
            sent += 1
    return sent


def step_inline() -> None:
    """Take woken turns' steps in this process, not on a turn worker (for processes whose own
    work may wait a few ms, not a prefork parent): no broker round trip after a last result."""
    runtime.get_store().stepper = _InlineSteps()


class _InlineSteps:
    def wake(self, turn_id: str) -> None:
        _step_here(run_step, turn_id)

    def lock_ms(self) -> int | None:
        return int(get_settings().step_lock_s * 1000)

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        _step_here(take_step, turn_id, view, token, lock_ms)


def _step_here(step: Callable[..., object], turn_id: str, *args: Any) -> None:
    try:
        store, app = runtime.get_store(), runtime.get_app()
        step(turn_id, *args, store=store, app=app, settings=get_settings())
    except Exception:
        # The turn is marked: a turn worker takes the step once a lock it held lapses.
        log.warning("turn %s: inline step failed; sending it", turn_id, exc_info=True)
        runtime.send_woken_step(turn_id)


def register_step_task(app: Celery) -> None:
    """The step task, `agentq.turn.step`, which turn workers take."""

    # A step that fails on Redis is sent again by Celery; its wakeup is the backstop.
    @app.task(
        name=k.TASK_STEP,
        queue=k.QUEUE_TURNS,
        acks_late=True,
        ignore_result=True,
        autoretry_for=(redis.ConnectionError, redis.TimeoutError),
        retry_backoff=1,
        retry_backoff_max=30,
        max_retries=20,
    )
    def step_task(turn_id: str) -> StepOutcome:
        return run_step(turn_id, store=runtime.get_store(), app=app, settings=get_settings())
