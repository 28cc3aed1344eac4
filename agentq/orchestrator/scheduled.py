"""A schedule's tick (sent by `agentq beat`, run by a turn worker): start its turn once per
tick, unless its last turn still runs. The tick is claimed with SET NX first, so two beats
that both sent it start one turn; the turn's id is derived from it too."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import AgentqError, ScheduleNotFound
from agentq.fleet import runtime
from agentq.models import TERMINAL_STATUSES, TurnRequest
from agentq.orchestrator.start import start_turn
from agentq.schedules.store import load_spec
from agentq.state.base import text

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.schedules")

TICK_KEY_TTL_S = 7 * 24 * 3600
"""How long a tick's claim is kept: longer than any redelivery of its message."""


def tick_turn_id(name: str, tick: str) -> str:
    """The turn id of a tick: the same for every message of that tick."""
    return hashlib.sha256(f"schedule:{name}:{tick}".encode()).hexdigest()[:32]


def run_tick(store: TurnStore, app: Celery, settings: Settings, name: str, tick: str) -> str:
    """Start the tick's turn; returns started, duplicate, skipped, gone or failed."""
    try:
        spec = load_spec(store.redis, name)
    except ScheduleNotFound:
        return "gone"
    redis = store.redis
    if not redis.set(k.schedule_key(name, tick), "1", nx=True, ex=TICK_KEY_TTL_S):
        return "duplicate"
    runs = k.schedule_key(name)
    last = redis.hget(runs, "last_turn_id")
    if last is not None and not spec.overlap:
        status = store.status(text(last))
        if status is not None and status not in TERMINAL_STATUSES:
            redis.hincrby(runs, "skipped", 1)
            log.info("schedule %s: tick %s skipped, turn %s still runs", name, tick, last)
            return "skipped"
    req = TurnRequest(
        prompt=spec.prompt,
        agent=spec.agent,
        headless=True,
        detach=True,
        webhook_url=spec.webhook_url,
    )
    try:
        handle = start_turn(
            store,
            app,
            settings,
            req,
            owner=spec.owner,
            turn_id=tick_turn_id(name, tick),
            extra_state={"schedule": name},
        )
    except AgentqError as exc:
        redis.hset(runs, mapping={"last_error": exc.message, "last_fired_at": time.time()})
        log.warning("schedule %s: tick %s did not start a turn: %s", name, tick, exc.message)
        return "failed"
    pipe = redis.pipeline()
    pipe.hset(runs, mapping={"last_turn_id": handle.turn_id, "last_fired_at": time.time()})
    pipe.hdel(runs, "last_error")
    pipe.hincrby(runs, "fired", 1)
    pipe.execute()
    log.info("schedule %s: tick %s started turn %s", name, tick, handle.turn_id)
    return "started"


def register_schedule_task(app: Celery) -> None:
    @app.task(name=k.TASK_SCHEDULE_TICK, acks_late=True, ignore_result=True)
    def scheduled(name: str, tick: str = "first") -> str:
        return run_tick(runtime.get_store(), app, get_settings(), name, tick)
