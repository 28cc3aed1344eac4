"""The plain Celery baseline of scripts/bench.py: one no-op task on its own queue.

Same broker and result backend as agentq (``AGENTQ_REDIS_URL``, or ``AGENTQ_BROKER_URL``
for the broker), JSON, and the two settings of agentq that change how a worker takes
work (late acks, prefetch 1), so the comparison measures agentq's own cost, not a
different Celery configuration. It is started by the bench as:

    python -m celery -A scripts.bench_celery_app worker -P prefork -c N -Q bench.noop
"""

from __future__ import annotations

import os

from celery import Celery

QUEUE = "bench.noop"
TASK = "bench.noop"

_redis_url = os.environ.get("AGENTQ_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery(
    "bench_celery",
    broker=os.environ.get("AGENTQ_BROKER_URL") or _redis_url,
    backend=_redis_url,
)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)


@app.task(name=TASK, queue=QUEUE)  # type: ignore[untyped-decorator]
def noop() -> None:
    """Do nothing; the caller waits for its (empty) result."""
    return None
