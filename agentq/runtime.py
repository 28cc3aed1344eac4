"""Process-wide singletons: settings, Redis client, store, Celery app."""

from __future__ import annotations

import logging
import threading

import redis
from celery import Celery

from agentq.config import Settings, get_settings
from agentq.connections import REDIS_MAX_CONNECTIONS, redis_client
from agentq.store import StepView, TurnStore

_lock = threading.Lock()
_redis: redis.Redis | None = None
_store: TurnStore | None = None
_app: Celery | None = None


def get_redis(settings: Settings | None = None) -> redis.Redis:
    global _redis
    with _lock:
        if _redis is None:
            s = settings or get_settings()
            _redis = redis_client(
                s.redis_url,
                s.redis_sentinel_master,
                socket_keepalive=True,
                health_check_interval=30,
                max_connections=REDIS_MAX_CONNECTIONS,
            )
        return _redis


def get_store(settings: Settings | None = None) -> TurnStore:
    global _store
    s = settings or get_settings()
    client = get_redis(s)
    with _lock:
        if _store is None:
            _store = TurnStore(
                client,
                log_maxlen=s.event_log_maxlen,
                ttl_s=s.state_ttl_s,
                waker=_send_step,
                stepper=_InlineStepper(),
                replicas_acked=s.replicas_acked,
                wait_timeout_ms=s.redis_wait_timeout_ms,
            )
        return _store


_inline_steps = False


def step_inline(enabled: bool = True) -> None:
    """Take a woken turn's step in this process instead of sending it to a turn worker.

    Worker processes that settle calls or finish model rounds switch it on: the step
    that follows the last result of a batch then costs no broker round trip. Only for
    processes whose own work it may delay by a few milliseconds (not a prefork parent).
    """
    global _inline_steps
    _inline_steps = enabled


def _send_step(turn_id: str) -> None:
    from agentq.orchestrator.steps import run_step, send_step

    if _inline_steps:
        try:
            run_step(turn_id, store=get_store(), app=get_app(), settings=get_settings())
            return
        except Exception:
            _inline_failed(turn_id)
    send_step(get_app(), turn_id)


def _inline_failed(turn_id: str) -> None:
    # The fact is recorded and the turn marked: a turn worker takes the step (once the
    # failed step's lock, if it held one, lapses; the wakeup sweep is the backstop).
    logging.getLogger("agentq.turn").warning(
        "turn %s: inline step failed; sending it", turn_id, exc_info=True
    )


class _InlineStepper:
    """Lets the write that wakes a turn take the step lock too, when steps run here."""

    def lock_ms(self) -> int | None:
        return int(get_settings().step_lock_s * 1000) if _inline_steps else None

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        from agentq.orchestrator.steps import send_step, take_step

        try:
            take_step(
                turn_id,
                view,
                token,
                lock_ms,
                store=get_store(),
                app=get_app(),
                settings=get_settings(),
            )
        except Exception:
            _inline_failed(turn_id)
            send_step(get_app(), turn_id)


def get_app() -> Celery:
    """The app of this process: the worker's when inside one, else a sender-only app."""
    global _app
    with _lock:
        if _app is None:
            from agentq.app import create_app

            _app = create_app(get_settings())
        return _app


def set_app(app: Celery) -> None:
    global _app
    _app = app


def reset() -> None:
    """Forget every singleton (tests that change settings)."""
    global _redis, _store, _app, _inline_steps
    get_settings.cache_clear()
    _inline_steps = False
    _redis = _store = _app = None
