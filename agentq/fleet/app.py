"""The Celery app factory, with production defaults for long, killable, redelivery-safe tasks."""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from agentq.config import Settings
from agentq.constants import QUEUE_IO, QUEUE_LLM, QUEUE_TOOLS, QUEUE_TURNS, QUEUE_WEBHOOKS
from agentq.fleet.connections import transport_options
from agentq.fleet.kombu_redis import patch_redis_transport


def create_app(settings: Settings) -> Celery:
    patch_redis_transport()
    app = Celery("agentq", broker=settings.broker, backend=settings.redis_url)
    conf: dict[str, Any] = {
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        # A task is acknowledged after it ran, so a dead worker's task is not lost.
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        # Only idempotent tools ask to be run again after their process died (per task).
        "task_reject_on_worker_lost": False,
        "task_acks_on_failure_or_timeout": True,
        # No visibility timeout: agentq's workers consume a Redis broker without kombu's
        # unacked hash (`agentq.worker`), so nothing is restored after one.
        "broker_transport_options": transport_options(
            settings.broker, settings.redis_sentinel_master
        ),
        "result_backend_transport_options": {
            "retry_policy": {"timeout": 5.0},
            **transport_options(settings.redis_url, settings.redis_sentinel_master),
        },
        "broker_connection_retry_on_startup": True,
        # Task events cost three publishes per task in the worker's event loop; Flower
        # switches worker events on by itself while it watches (`enable_events`).
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": settings.task_events,
        # agentq's broadcasts (revoke) reach agentq's workers only, not every Celery
        # app on the same broker.
        "control_exchange": "agentq",
        "result_expires": 24 * 3600,
        "task_default_queue": QUEUE_TOOLS,
        "task_queues": tuple(
            Queue(q)  # type: ignore[no-untyped-call]
            for q in (QUEUE_TOOLS, QUEUE_IO, QUEUE_LLM, QUEUE_TURNS, QUEUE_WEBHOOKS)
        ),
        "task_routes": {
            "agentq.turn.*": {"queue": QUEUE_TURNS},
            "agentq.llm.*": {"queue": QUEUE_LLM},
            "agentq.tool.*": {"queue": QUEUE_TOOLS},
            "agentq.webhook.*": {"queue": QUEUE_WEBHOOKS},
        },
        # A broker blip must not kill running tools: they settle through Redis, and a
        # message handed out again is not run twice.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }
    if settings.broker.startswith(("amqp", "pyamqp")):
        # Publisher confirms: a send returns once RabbitMQ has the message on disk, so a
        # broker that crashes right after loses no call or round a turn counts as sent.
        conf["broker_transport_options"] = {"confirm_publish": True}
    app.conf.update(conf)
    return app
