"""How agentq sends to its broker: short task reprs, BrokerUnavailable for a broker that
stays away, and the step message."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from agentq.constants import QUEUE_TURNS, TASK_STEP
from agentq.errors import BrokerUnavailable

if TYPE_CHECKING:
    from celery import Celery

BROKER_RETRY_S = 1.0
"""A publish the broker refused past kombu's retries is tried again this much later, by
the turn's wakeup: the wakeups in Redis are agentq's outbox."""

log = logging.getLogger("agentq.broker")

REPR_LIMIT = 200
"""Characters of a task's arguments that Flower and the worker log show."""


def task_repr(**fields: Any) -> str:
    """A task's arguments for Flower and logs, without Celery's saferepr (a millisecond per
    send for a model round's tool schemas)."""
    text = json.dumps(fields, default=str, separators=(",", ":"))
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 1] + "…"


def publish(app: Celery, name: str, *, what: str, **options: Any) -> None:
    """Send a task; BrokerUnavailable for a broker away past kombu's retries."""
    try:
        app.send_task(name, **options)
    except _broker_errors(app) as exc:
        raise BrokerUnavailable(what, f"{type(exc).__name__}: {exc}") from exc


def queue_size(app: Celery, queue: str) -> int | None:
    """Messages waiting in a broker queue (not those workers hold); None if it cannot tell."""
    try:
        with app.connection_for_read() as conn, conn.channel() as channel:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except Exception as exc:  # any transport's refusal means the same: unknown
        log.debug("size of queue %s unknown: %s", queue, exc)
        return None


def revoke(app: Celery, task_ids: str | list[str], **options: Any) -> bool:
    """Revoke tasks (`terminate`, `signal`, `destination` as Celery's revoke takes them);
    False if the broker is away (a task that runs on finds its call settled already, and
    its result is dropped: only its worker's time is lost)."""
    to = options.pop("destination", None)
    return broadcast(app, "revoke", {"task_id": task_ids, **options}, destination=to)


def broadcast(
    app: Celery, command: str, arguments: dict[str, Any], *, destination: list[str] | None
) -> bool:
    """Send a remote control command to these workers (None: all); False if the broker is away."""
    try:
        app.control.broadcast(command, arguments=arguments, destination=destination)
    except _broker_errors(app) as exc:
        log.warning("%s %s not sent: the broker is away (%s)", command, arguments, exc)
        return False
    return True


def _broker_errors(app: Celery) -> tuple[type[BaseException], ...]:
    """The errors of a broker that is away (an `except` clause evaluates this only when a
    send raised)."""
    from kombu.exceptions import OperationalError

    with app.connection_for_write() as conn:
        # For Redis these include its channel errors (kombu's fallback for a transport
        # without recoverable errors of its own), ResponseError among them: kept, as
        # READONLY and MASTERDOWN during a failover are ResponseErrors that mean the
        # broker is away for now; a refused command is then left to the wakeup too.
        return (OperationalError, *conn.recoverable_connection_errors)


def send_step(app: Celery, turn_id: str) -> None:
    """Ask a turn worker for one step of the turn (BrokerUnavailable if the broker is away)."""
    publish(
        app,
        TASK_STEP,
        what=f"the step of turn {turn_id}",
        args=[turn_id],
        queue=QUEUE_TURNS,
        argsrepr=f"['{turn_id}']",
        kwargsrepr="{}",
        ignore_result=True,
    )
