"""The plain Celery baselines of scripts/bench.py: one no-op task on its own queue, and a
turn as plain Celery tasks (`turn_round`, `turn_tools`) for the shapes stage.

Same broker and result backend as agentq (``AGENTQ_REDIS_URL``, or ``AGENTQ_BROKER_URL``
for the broker), JSON, and the two settings of agentq that change how a worker takes
work (late acks, prefetch 1), so the comparison measures agentq's own cost, not a
different Celery configuration. It is started by the bench as:

    python -m celery -A scripts.bench_celery_app worker -P prefork -c N -Q bench.noop

A plain Celery turn is what a Celery user would write with no runtime around it: a round
task streams the model with the sync OpenAI SDK on a thread pool, hands the round's tool
calls to a tool task, whose end sends the next round; the last round counts the turn done
(one INCR). No state, no events, no time limits, no cancellation: it is the floor any
Celery-based design stands on, on the same broker, server and shapes as agentq's fleet.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import worker_init

from scripts.bench_raw_sdk import (
    MAX_ROUNDS,
    TURNS_PER_CLIENT,
    add_chunk,
    assistant_message,
    tool_seconds,
    warm_up,
)

QUEUE = "bench.noop"
TASK = "bench.noop"
ROUNDS = "bench.rounds"
"""The plain Celery turn's rounds, and its async-shaped tools (a thread waits them out)."""
SYNC_TOOLS = "bench.sync_tools"
"""The plain Celery turn's sync tools, on a prefork pool as agentq's tool worker runs them."""

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


_local = threading.local()
_clients: list[Any] = []
_slots = itertools.count()
_redis_client: Any = None


@worker_init.connect  # type: ignore[untyped-decorator]
def _warm(**_kw: Any) -> None:
    """The rounds worker's SDK clients, made and warmed before any turn (a long-running
    worker's are): a client per TURNS_PER_CLIENT threads, as the raw loop shares them."""
    if os.environ.get("BENCH_PLAIN_CLIENTS") is None:
        return
    import httpx2
    from openai import OpenAI

    for _ in range(int(os.environ["BENCH_PLAIN_CLIENTS"])):
        client = OpenAI(
            base_url=os.environ["AGENTQ_LLM_BASE_URL"],
            api_key="bench",
            max_retries=0,
            http_client=httpx2.Client(
                limits=httpx2.Limits(max_connections=TURNS_PER_CLIENT), timeout=120
            ),
        )
        client.chat.completions  # noqa: B018  (the SDK loads its resources on first use)
        _clients.append(client)
    warm_up()


def _client() -> Any:
    """This thread's SDK client, one of the warmed ones."""
    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = _clients[next(_slots) % len(_clients)]
    return client


def _redis() -> Any:
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(_redis_url)
    return _redis_client


@app.task(name="bench.turn_round", queue=ROUNDS, ignore_result=True)  # type: ignore[untyped-decorator]
def turn_round(messages: list[dict[str, Any]], done_key: str, tool_queue: str) -> None:
    """Stream one round; send its calls to a tool task, or count the turn done."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    stream = _client().chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True)
    for chunk in stream:
        add_chunk(chunk, text, calls)
    if not calls or len(messages) > 2 * MAX_ROUNDS:
        _redis().incr(done_key)
        return
    messages.append(assistant_message(text, calls))
    turn_tools.apply_async((messages, list(calls.values()), done_key, tool_queue), queue=tool_queue)


@app.task(name="bench.turn_tools", ignore_result=True)  # type: ignore[untyped-decorator]
def turn_tools(
    messages: list[dict[str, Any]], calls: list[dict[str, Any]], done_key: str, tool_queue: str
) -> None:
    """Run a round's calls (the shapes' tools only wait), then send the next round."""
    for call in calls:
        time.sleep(tool_seconds(call))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "null"})
    turn_round.apply_async((messages, done_key, tool_queue), queue=ROUNDS)
