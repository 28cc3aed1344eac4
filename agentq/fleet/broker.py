"""What agentq changes in kombu's Redis transport, the task reprs it hands Celery, and the
step message every part of agentq sends.

Both exist for the hot path: a step sends a task or two, and at thousands of turns the
transport's per-publish costs were a third of a turn worker's CPU. The patches touch
kombu internals, which is why pyproject.toml bounds kombu's version.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from agentq.constants import QUEUE_LLM, QUEUE_TURNS, TASK_LLM_START, TASK_STEP
from agentq.errors import BrokerUnavailable

if TYPE_CHECKING:
    from celery import Celery

BROKER_RETRY_S = 1.0
"""A publish the broker refused past kombu's retries is tried again this much later, by
the turn's wakeup: the wakeups in Redis are agentq's outbox."""

log = logging.getLogger("agentq.broker")

_unrestored: list[tuple[dict[str, Any], str, str]] = []
"""Messages this process could not put back on its broker (payload, exchange, routing
key), for the next channel that consumes from it."""
_unrestored_lock = threading.Lock()

REPR_LIMIT = 200
"""Characters of a task's arguments that Flower and the worker log show."""


def patch_redis_transport() -> None:
    """Apply agentq's changes to kombu's Redis channel once per process."""
    import redis
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel, "agentq_patched", False):
        return

    # Keep a worker alive when its Redis broker restarts while tasks are unacked: Celery
    # 5.7 / kombu 5.7 close the lost connection's transport before its channel; the
    # channel then tries to restore its unacked messages through the closed transport and
    # raises AttributeError, which Celery treats as unrecoverable and exits. A connection
    # error instead lets Celery reconnect as it does for any broker loss. A publish on a
    # channel closed under it (a Sentinel failover) has no connection at all: the same.
    connparams = channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise redis.exceptions.ConnectionError("the broker connection is closed")
        return connparams(self, asynchronous)  # type: ignore[no-untyped-call]

    # kombu builds a new redis.Redis around the channel's pool for every publish (half a
    # millisecond of response-callback tables each time): one per pool does, since a
    # redis.Redis is safe to share between threads.
    create_client = channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return create_client(self, asynchronous=True)  # type: ignore[no-untyped-call]
        pool = self.pool
        cached = self.__dict__.get("_agentq_client")
        if cached is None or cached[0] is not pool:
            cached = (pool, create_client(self))  # type: ignore[no-untyped-call]
            self.__dict__["_agentq_client"] = cached
        return cached[1]

    # Give back what a worker held when its broker connection broke. Celery drops the
    # requests it had received and not started (`Consumer.on_close`), and kombu puts every
    # unacknowledged message back as the channel closes: through a broker that is away by
    # then. With kombu's unacked hash (off in agentq's workers: `agentq.worker`) its
    # visibility timeout would restore them an hour later; here they wait in the process
    # and go back to their queues through the first channel that consumes again. One
    # that ran (or runs) already is refused by its call's start claim, a step by the
    # turn's lock, a model round by its claim: none runs twice.
    restore = channel._restore
    lost = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

    def _restore(self: Any, message: Any, leftmost: bool = False) -> Any:
        try:
            return restore(self, message, leftmost)  # type: ignore[no-untyped-call]
        except lost:
            if self.ack_emulation:
                raise
            payload = message.serializable()
            payload["redelivered"] = True
            info = message.delivery_info
            with _unrestored_lock:
                _unrestored.append((payload, info["exchange"], info["routing_key"]))
            log.warning(
                "the broker is away: message %s kept to put back on %r when it returns",
                message.properties.get("correlation_id"),
                info["routing_key"],
            )
            return None

    basic_consume = channel.basic_consume

    def _basic_consume(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
        answer = basic_consume(self, queue, *args, **kwargs)  # type: ignore[no-untyped-call]
        if _unrestored:
            _give_back(self)
        return answer

    channel._connparams = _connparams  # type: ignore[method-assign]
    channel._create_client = _create_client  # type: ignore[method-assign]
    channel._restore = _restore  # type: ignore[method-assign]
    channel.basic_consume = _basic_consume  # type: ignore[method-assign]
    channel.agentq_patched = True  # type: ignore[attr-defined]


def _give_back(channel: Any) -> None:
    """Put the messages kept by `_restore` back on their queues through `channel`; those
    it cannot wait for the next channel."""
    with _unrestored_lock:
        kept = list(_unrestored)
        _unrestored.clear()
    for i, (payload, exchange, routing_key) in enumerate(kept):
        try:
            for queue in channel._lookup(exchange, routing_key):
                channel._put(queue, payload)
        except Exception as exc:
            with _unrestored_lock:
                _unrestored.extend(kept[i:])
            log.warning("%d messages not put back yet: %s", len(kept) - i, exc)
            return
    log.info("put %d messages back on the broker after its connection returned", len(kept))


def task_repr(**fields: Any) -> str:
    """A short repr of a task's arguments, made without Celery's saferepr (a millisecond
    per send for a model round's tool schemas)."""
    text = json.dumps(fields, default=str, separators=(",", ":"))
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 1] + "…"


def publish(app: Celery, name: str, *, what: str, **options: Any) -> None:
    """Send a task; a broker that stays away past kombu's retries raises BrokerUnavailable
    (whatever the transport raised), which the caller leaves to the turn's wakeup."""
    try:
        app.send_task(name, **options)
    except _broker_errors(app) as exc:
        raise BrokerUnavailable(what, f"{type(exc).__name__}: {exc}") from exc


def queue_size(app: Celery, queue: str) -> int | None:
    """Messages waiting in a broker queue (not those a worker holds unacknowledged); None
    when the broker cannot tell (it is away, or the queue does not exist)."""
    try:
        with app.connection_for_read() as conn, conn.channel() as channel:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except Exception as exc:  # any transport's refusal means the same: unknown
        log.debug("size of queue %s unknown: %s", queue, exc)
        return None


def revoke(app: Celery, task_ids: str | list[str], **options: Any) -> bool:
    """Revoke tasks; False if the broker is away (a task that runs on finds its call
    settled already, and its result is dropped: only its worker's time is lost)."""
    try:
        app.control.revoke(task_ids, **options)
    except _broker_errors(app) as exc:
        log.warning("revoke of %s not sent: the broker is away (%s)", task_ids, exc)
        return False
    return True


def _broker_errors(app: Celery) -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] | None = app.__dict__.get("_agentq_broker_errors")
    if errors is None:
        from kombu.exceptions import OperationalError

        conn = app.connection_for_write()
        try:
            # Not its channel errors: for Redis those include KeyError and ResponseError.
            errors = (OperationalError, *conn.recoverable_connection_errors)
        finally:
            conn.release()
        app.__dict__["_agentq_broker_errors"] = errors
    return errors


def send_step(app: Celery, turn_id: str, *, model_first: bool = False) -> None:
    """Ask a turn worker for one step of the turn (BrokerUnavailable if the broker is away:
    the turn's wakeup sends it later).

    `model_first`: the new turn's first step sends a model round, so a stream worker takes
    it (`agentq.llm.start`) and streams that round itself: one delivery fewer per turn.
    """
    publish(
        app,
        TASK_LLM_START if model_first else TASK_STEP,
        what=f"the step of turn {turn_id}",
        args=[turn_id],
        queue=QUEUE_LLM if model_first else QUEUE_TURNS,
        argsrepr=f"['{turn_id}']",
        kwargsrepr="{}",
        ignore_result=True,
    )
