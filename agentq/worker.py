"""The Celery app of agentq workers (`celery -A agentq.worker ...` works too)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery.signals import worker_init, worker_ready

from agentq.app import create_app
from agentq.config import get_settings
from agentq.llm.task import register_llm_task
from agentq.orchestrator.turn import register_turn_task
from agentq.runtime import get_store, set_app
from agentq.tools.registry import all_tools, load_tool_modules
from agentq.tools.task import register_tool_tasks

log = logging.getLogger("agentq.worker")


def _survive_broker_restarts() -> None:
    """Keep a worker alive when its Redis broker restarts while tasks are unacked.

    Celery 5.7 / kombu 5.7 close the lost connection's transport before its channel; the
    channel then tries to restore its unacked messages through the closed transport and
    raises AttributeError, which Celery treats as unrecoverable and exits. Raising a
    connection error there instead lets Celery reconnect as it does for any broker loss.
    """
    import redis
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.Channel._connparams
    if getattr(original, "agentq_patched", False):
        return

    def connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError("the broker connection is closed")
        return original(self, asynchronous)  # type: ignore[no-untyped-call]

    connparams.agentq_patched = True  # type: ignore[attr-defined]
    kombu_redis.Channel._connparams = connparams  # type: ignore[method-assign]


_survive_broker_restarts()
settings = get_settings()
load_tool_modules(settings.tool_modules)
_longest = max([settings.tool_timeout_s] + [t.policy.timeout_s for t in all_tools().values()])
app = create_app(settings, longest_tool_timeout_s=_longest)
set_app(app)
register_turn_task(app)
register_llm_task(app)
tool_queues = register_tool_tasks(app)

PREFORK_POOLS = ("prefork", "processes")


@worker_init.connect
def _check_pool(sender: Any = None, **_: Any) -> None:
    """A tool worker on a pool that cannot kill a process would not enforce hard limits."""
    if os.environ.get("AGENTQ_WORKER_KIND") != "tools":
        return
    pool = getattr(sender, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    if not any(p in str(name) for p in PREFORK_POOLS):
        raise SystemExit(
            f"agentq: the tool worker needs the prefork pool (got {name}); "
            "hard time limits are only enforced there"
        )


@worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    """A tool worker says it is alive, so a turn can settle the calls of a dead one
    without waiting for their hard limit (or forever, for tools without one)."""
    if os.environ.get("AGENTQ_WORKER_KIND") != "tools":
        return
    import threading

    from agentq.constants import WORKER_ALIVE_TTL_S, WORKER_HEARTBEAT_S, worker_alive_key

    key = worker_alive_key(str(getattr(sender, "hostname", "")))
    redis = get_store().redis

    def beat() -> None:
        while True:
            try:
                redis.set(key, os.getpid(), px=int(WORKER_ALIVE_TTL_S * 1000))
            except Exception:
                log.warning("worker heartbeat failed", exc_info=True)
            time.sleep(WORKER_HEARTBEAT_S)

    threading.Thread(target=beat, name="agentq-heartbeat", daemon=True).start()


@worker_ready.connect
def _start_reaper(**_: Any) -> None:
    if os.environ.get("AGENTQ_WORKER_KIND") != "turns":
        return
    from agentq.constants import QUEUE_TURNS, TASK_TURN
    from agentq.orchestrator.lease import Reaper

    def resume(turn_id: str) -> None:
        app.send_task(TASK_TURN, args=[turn_id], queue=QUEUE_TURNS, ignore_result=True)

    Reaper(get_store(), settings.turn_lease_s, resume).start()
    log.info("agentq turn worker ready: lease %.1fs, reaper on", settings.turn_lease_s)
