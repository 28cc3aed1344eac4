"""The one module that reaches into kombu's private Redis channel, for three things kombu
has no option or hook for: a channel closed under it raises a connection error Celery
recovers from (`_connparams`), one redis client serves a connection pool
(`_create_client`), and what a worker held when its broker went away goes back to its
queues when it returns (`_restore`, `basic_consume`).

`check_channel` compares the installed kombu with `REACHED` before anything is wrapped, at
a worker's start and in tests/unit/test_kombu_redis.py, so a kombu that changed them
fails loudly, never silently.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from agentq.errors import IncompatibleDependency

log = logging.getLogger("agentq.broker")

REACHED: dict[str, tuple[str, ...]] = {
    "_connparams": ("self", "asynchronous"),
    "_create_client": ("self", "asynchronous"),
    "_restore": ("self", "message", "leftmost"),
    "_lookup": ("self", "exchange", "routing_key"),
    "_put": ("self", "queue", "message"),
    "basic_consume": ("self", "queue"),
}
"""The Channel members agentq calls or wraps, and the leading parameters it passes."""
READ = ("ack_emulation", "pool")
"""The Channel attributes the wrappers read."""

_unrestored: list[tuple[dict[str, Any], str, str]] = []
"""(payload, exchange, routing key) of messages not yet put back on the broker."""
_unrestored_lock = threading.Lock()


def check_channel(channel: Any) -> None:
    """Raise IncompatibleDependency unless `channel` has REACHED and READ as agentq uses them."""
    import kombu

    for name in (*REACHED, *READ):
        if not hasattr(channel, name):
            raise IncompatibleDependency("kombu", kombu.__version__, f"Channel.{name} is gone")
    for name, params in REACHED.items():
        got = tuple(inspect.signature(getattr(channel, name)).parameters)[: len(params)]
        if got != params:
            raise IncompatibleDependency(
                "kombu", kombu.__version__, f"Channel.{name}{got} is not {name}{params}"
            )


def patch_redis_transport() -> None:
    """Apply agentq's changes to kombu's Redis channel once per process."""
    import redis
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    if getattr(channel, "agentq_patched", False):
        return
    check_channel(channel)

    # kombu 5.7 closes a lost connection's transport before its channel, whose restore of
    # its unacked messages (or a publish after a Sentinel failover) then raised
    # AttributeError, which Celery treats as fatal; a connection error it reconnects from.
    connparams = channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise redis.exceptions.ConnectionError("the broker connection is closed")
        return connparams(self, asynchronous)  # type: ignore[no-untyped-call]

    # kombu builds a redis.Redis around the pool for every publish (half a millisecond of
    # callback tables); one per pool does, as a redis.Redis is thread-safe.
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

    # Celery drops the requests it held unstarted when its broker connection broke, and
    # kombu puts them back through that broker, away by then (without the unacked hash,
    # off in `agentq.worker`, nothing restores them): they wait here for the first channel
    # that consumes again. One that ran already is refused by its call's start claim, a
    # step by the turn's lock, a round by its claim: none runs twice.
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
    """Put the messages `_restore` kept back on their queues; those it cannot wait on."""
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
