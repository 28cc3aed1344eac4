"""The Celery app of agentq workers: `agentq worker KIND`, `celery -A agentq worker -Q ...`.

Each worker's role comes from the queues it consumes (agentq.fleet.roles), decided when it starts.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.signals import (
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from agentq import constants as k
from agentq.agents import load_tool_modules, publish_agents
from agentq.config import get_settings
from agentq.errors import ConfigError
from agentq.fleet import health, roles
from agentq.fleet.app import create_app
from agentq.fleet.presence import entry
from agentq.fleet.runtime import get_store, set_app
from agentq.llm.limits import parse_limits
from agentq.llm.task import register_llm_task, warm
from agentq.mcp.catalog import connect_mcp, load_mcp
from agentq.mcp.servers import parse_servers
from agentq.orchestrator.scheduled import register_schedule_task
from agentq.orchestrator.steps import Sweeper, register_step_task, step_inline
from agentq.telemetry import logs, tracing
from agentq.telemetry.fleetcounts import fleet_counts
from agentq.tools.registry import all_tools
from agentq.tools.task import queues_of, register_tool_tasks
from agentq.webhooks.task import register_webhook_task, start_sweeper

log = logging.getLogger("agentq.worker")

LEAVE_TIMEOUT_S = 2.0
"""Longest a stopping worker waits to take itself out of the fleet's presence."""
BROKER_POOL = {"turns": 4, "llm": 2, "io": 2}
"""Broker connections a worker keeps for publishing, from a few threads (Celery's: ten)."""


settings = get_settings()
logs.connect_celery_signals(settings.log_format)
if not settings.task_received_logs:
    # Before the consumer's strategies read the level: at INFO the lines cost a sixth of an
    # I/O worker's CPU in the benchmark's io stage.
    logging.getLogger("celery.worker.strategy").setLevel(logging.WARNING)
load_tool_modules(settings.tools)
# The tools of AGENTQ_MCP_SERVERS join the registry before its tasks are registered.
load_mcp(settings, lambda: get_store().redis)
# A bad AGENTQ_LLM_LIMITS stops the worker at start, naming the setting.
parse_limits(settings.llm_limits)
# How long an event-loop worker lets its calls end before it goes: the longest call limit.
_longest = max(
    [settings.tool_timeout_s]
    + [max(t.policy.timeout_s, t.policy.max_timeout_s or 0) for t in all_tools().values()]
)
app = create_app(settings)
set_app(app)
if settings.health_file:
    health.install(app, settings.health_file)
register_step_task(app)
register_llm_task(app)
register_webhook_task(app, get_store, get_settings)
register_schedule_task(app)
tool_queues = register_tool_tasks(app)
# An MCP server's queue is known from its setting before the I/O worker lists its tools.
mcp_queues = [s.queue for s in parse_servers(settings.mcp_servers).values() if s.queue]
io_queues = sorted({*queues_of(all_tools(), io=True), *mcp_queues, k.QUEUE_WEBHOOKS})


@worker_init.connect
def _take_role(sender: Any = None, **_: Any) -> None:
    """Decide this worker's role from its queues and refuse a pool that cannot serve it."""
    consumed = sender.app.amqp.queues.consume_from
    try:
        role = roles.role_of(consumed.keys(), tool_queues, io_queues)
    except ConfigError as exc:
        raise SystemExit(f"agentq: {exc}") from None
    pool = getattr(sender, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    problem = roles.pool_problem(role, str(name))
    if problem:
        raise SystemExit(f"agentq: {problem}")
    roles.role = role
    if role in BROKER_POOL:
        sender.app.conf.broker_pool_limit = BROKER_POOL[role]
    if settings.broker.startswith(("redis", "sentinel")):
        # kombu's unacked hash costs eight Redis commands a message and guards nothing that
        # agentq's own resends (rounds, steps, calls, webhooks) do not guard long before its
        # hour-long visibility timeout; a warm shutdown or a broken connection still requeues.
        sender.app.conf.broker_transport_options = {
            **sender.app.conf.broker_transport_options,
            "ack_emulation": False,
        }
    # Here, not at import: the role names the service, and a prefork pool forks after this.
    tracing.setup(role, otel=settings.otel, spans_file=settings.otel_spans_file)
    if role == "tools":
        # Frozen before the prefork pool forks: a collection in a child would write to (and
        # so copy) every page it shares with the parent.
        gc.collect()
        gc.freeze()


def _start_heartbeat(hostname: str, kind: str, consumed: list[str]) -> None:
    """Say this worker is alive and what it consumes; a tool worker's beat also lets a turn
    settle a dead worker's calls without waiting for their hard limit (or forever)."""
    if kind == "io":
        from agentq.aio.host import get_host

        # The loop is up before the first task, and blame names this worker.
        get_host().hostname = hostname
    key = k.worker_alive_key(hostname)
    redis = get_store().redis

    def beat() -> None:
        while not _stopping.is_set():
            try:
                pipe = redis.pipeline(transaction=False)
                pipe.hset(k.PRESENCE, hostname, entry(kind, consumed))
                if kind in roles.HEARTBEAT_ROLES:
                    pipe.set(key, os.getpid(), px=int(k.WORKER_ALIVE_TTL_S * 1000))
                    # The sweepers find a dead worker here and wake its calls' turns at once.
                    pipe.zadd(k.WORKERS, {hostname: time.time()})
                pipe.execute()
            except Exception:
                log.warning("worker heartbeat failed", exc_info=True)
            _stopping.wait(k.WORKER_HEARTBEAT_S)
        with contextlib.suppress(Exception):
            redis.hdel(k.PRESENCE, hostname)

    _beating.append(threading.Thread(target=beat, name="agentq-heartbeat", daemon=True))
    _beating[-1].start()


_stopping = threading.Event()
_beating: list[threading.Thread] = []


@worker_shutdown.connect
def _leave(**_: Any) -> None:
    """A worker that stops cleanly is gone from the fleet's presence at once."""
    _stopping.set()
    for thread in _beating:
        thread.join(LEAVE_TIMEOUT_S)


@worker_shutdown.connect
def _drain_loop(**_: Any) -> None:
    """An event-loop worker acknowledged its calls at hand-off: let them end before it goes."""
    if roles.role not in ("io", "llm"):
        return
    from agentq.aio import host as aio_host

    host = aio_host._host
    if host is None:
        return
    deadline = time.monotonic() + max(_longest, settings.stream_duration_s)
    if host.loop.held:
        log.info("waiting for %d coroutines on the event loop to end", host.loop.held)
    while host.loop.held and time.monotonic() < deadline:
        time.sleep(0.1)


@worker_process_init.connect
def _inline_steps_in_tool_children(**_: Any) -> None:
    """A prefork child that settles a batch's last call takes the turn's next step itself."""
    if roles.role == "tools":
        step_inline()


@worker_ready.connect
def _ready(sender: Any, **_: Any) -> None:
    """What a worker of each role starts once ready; a part that fails is logged and the rest
    still start (a heartbeat that cannot reach Redis must not stop the sweeper)."""
    role = str(roles.role)  # set by _take_role at worker_init, which comes first
    consumed = sorted(sender.app.amqp.queues.consume_from)  # sender: Celery's Consumer
    parts: list[Callable[[], object]] = [lambda: _start_heartbeat(sender.hostname, role, consumed)]
    log.info("agentq %s worker: consuming %s", role, ", ".join(consumed))
    if role in ("io", "llm"):
        # They settle from threads beside their loop, so take the next step themselves too.
        parts.append(step_inline)
    if role == "llm":
        # Imported and built on the event loop, the OpenAI client (seconds on a busy
        # machine) would stall every stream.
        parts.append(warm)
    if role == "turns":
        # Before Celery logs "ready.": a client that waits for it finds the agents known.
        parts.append(lambda: publish_agents(get_store().redis))
        parts.append(lambda: Sweeper(get_store(), app, settings).start())
    if k.QUEUE_WEBHOOKS in consumed:
        # Whoever delivers webhooks sends their due retries (and a lost message again).
        parts.append(lambda: start_sweeper(get_store(), app, settings))
    for part in parts:
        try:
            part()
        except Exception:
            log.exception("agentq %s worker: a part of its start failed", role)


@worker_process_shutdown.connect
@worker_shutdown.connect
def _flush_telemetry(**_: Any) -> None:
    """Export buffered spans and fleet counts (a prefork child runs no atexit hooks)."""
    tracing.shutdown()
    try:
        fleet_counts.flush(get_store().redis)
    except Exception:
        log.debug("fleet counts not flushed at exit", exc_info=True)


# After _drain_loop: the calls on the loop end before their MCP sessions stop.
connect_mcp(lambda specs: register_tool_tasks(app, specs))
