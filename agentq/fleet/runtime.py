"""Process-wide singletons: the store and its Redis client, the Celery app, and how a woken
turn's step is taken (sent to a turn worker, or here by `steps.step_inline`)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, cast

import redis

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import BrokerUnavailable
from agentq.fleet.broker import send_step
from agentq.fleet.connections import REDIS_MAX_CONNECTIONS, cluster_client, redis_client
from agentq.state.base import StepView
from agentq.state.store import TurnStore

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("agentq.broker")

_lock = threading.Lock()
_store: TurnStore | None = None
_app: Celery | None = None


def get_store(settings: Settings | None = None) -> TurnStore:
    """The store of this process, on its Redis client (`store.redis`)."""
    global _store
    with _lock:
        if _store is None:
            s = settings or get_settings()
            k.set_shard_count(s.shard_count)
            options: dict[str, Any] = {
                "socket_keepalive": True,
                "health_check_interval": 30,
                "max_connections": REDIS_MAX_CONNECTIONS,
            }
            # The store sends a Cluster only one-slot scripts and transactions and the
            # commands both clients share (see agentq.constants on shards).
            client = (
                cast(redis.Redis, cluster_client(s.redis_cluster_nodes, **options))
                if s.redis_cluster_nodes
                else redis_client(s.redis_url, s.redis_sentinel_master, **options)
            )
            _store = TurnStore(
                client,
                log_maxlen=s.event_log_maxlen,
                ttl_s=s.turn_retention_s,
                stepper=_Sender(),
                replicas_acked=s.replicas_acked,
                wait_timeout_ms=s.redis_wait_timeout_ms,
                metrics_flush_s=s.metrics_flush_s,
            )
        return _store


def send_woken_step(turn_id: str) -> None:
    """Send the step of a turn a write just woke; with the broker away, its wakeup will."""
    try:
        send_step(get_app(), turn_id)
    except BrokerUnavailable as exc:
        log.warning("%s; the turn's wakeup sends it later", exc)


class _Sender:
    """The store's stepper until steps.step_inline replaces it: steps go to a turn worker."""

    def wake(self, turn_id: str) -> None:
        send_woken_step(turn_id)

    def lock_ms(self) -> int | None:
        return None  # no write takes a step lock for this process

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        send_woken_step(turn_id)


def get_app() -> Celery:
    """The app of this process: the worker's when inside one, else a sender-only app."""
    global _app
    with _lock:
        if _app is None:
            from agentq.fleet.app import create_app

            _app = create_app(get_settings())
        return _app


def set_app(app: Celery) -> None:
    global _app
    _app = app


def reset() -> None:
    """Forget every singleton (tests that change settings)."""
    global _store, _app
    get_settings.cache_clear()
    k.set_shard_count(None)
    _store = _app = None
