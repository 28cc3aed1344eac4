"""The prefork tool worker: the Celery task that runs and settles a call, and the kill command."""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from billiard.exceptions import WorkerLostError
from billiard.pool import SIG_SOFT_TIMEOUT
from celery import Celery, Task
from celery.exceptions import TimeLimitExceeded
from celery.signals import task_failure
from celery.worker import state as worker_state
from celery.worker.control import control_command

from agentq import constants as k
from agentq.config import get_settings
from agentq.fleet.runtime import get_store
from agentq.models import ToolTaskRequest
from agentq.state.held import held_writes
from agentq.telemetry import tracing
from agentq.tools import calls
from agentq.tools.registry import ToolSpec, all_tools
from agentq.tools.results import lost_result

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.tools")


class _Ticker:
    """One thread per process ticks its running call: a thread per call cost more than a call."""

    def __init__(self) -> None:
        self._current: tuple[TurnStore, calls.CallScope, float] | None = None
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(
        self, store: TurnStore, scope: calls.CallScope, interval_s: float
    ) -> Iterator[None]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # Started lazily, after the fork: a thread does not survive into a child.
                self._thread = threading.Thread(target=self._run, name="agentq-tick", daemon=True)
                self._thread.start()
        self._current = (store, scope, interval_s)
        self._changed.set()
        try:
            yield
        finally:
            current = self._current
            if current is not None and current[1] is scope:
                self._current = None

    def _run(self) -> None:
        """Asleep between calls; during one, a tick every interval until another begins."""
        while self._changed.wait():
            self._changed.clear()
            current = self._current
            while current is not None and not self._changed.wait(current[2]):
                if current is not self._current:
                    break  # the call is over
                calls.tick(*current[:2])


_ticker = _Ticker()


@contextlib.contextmanager
def _soft_limit(scope: calls.CallScope) -> Iterator[None]:
    """Set `scope.soft_fired` when the pool's soft limit fires, even if the tool catches it
    (the pool's clock starts a little before the call's, so the call's may read just under).
    A signal before half the call's soft limit was meant for an earlier call: a pool whose
    loop stood still (a 25 s Redis outage) fires overdue timers before reading results."""
    sig = SIG_SOFT_TIMEOUT
    prev = signal.getsignal(sig) if sig is not None else None
    if not callable(prev) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def seen(signum: int, frame: Any) -> None:
        req, ran_s = scope.req, time.time() - scope.started
        soft_s = req.soft_timeout_s or 0.0
        if scope.done or soft_s <= 0 or ran_s < soft_s / 2:
            when = "after it finished" if scope.done else f"at {ran_s:.1f} s of its {soft_s:.1f} s"
            log.warning("call %s (%s): a soft time limit %s: ignored", req.call_id, req.tool, when)
            return
        scope.soft_fired = True
        prev(signum, frame)

    signal.signal(sig, seen)
    try:
        yield
    finally:
        signal.signal(sig, prev)


def run_call(task: Task, spec: ToolSpec, req: ToolTaskRequest) -> str:
    """Run one call and settle its result; the return value is only for Flower."""
    store = get_store()
    settings = get_settings()
    scope, delivery = calls.task_scope(task.request, req)
    why_not = calls.mark_started(store, scope, delivery)
    if why_not is not None:
        return why_not
    ctx = calls.tool_context(store, scope, task.backend, operator.call)
    value: Any = None
    raised: Exception | None = None
    # Only an Exception ends the span "error": a SystemExit (hard limit, revoke) leaves it
    # open, unexported, for whoever settles the call (the worker's parent, the abort).
    with calls.observed(scope, Exception) as span, _soft_limit(scope):
        try:
            with _ticker.running(store, scope, settings.progress_interval_s):
                value = calls.invoke(spec, ctx, req)
        except Exception as exc:  # the soft limit's SoftTimeLimitExceeded among them
            raised = exc
        scope.done = True
        result = calls.outcome(
            scope, spec, settings, aborted=ctx._cancelled, raised=raised, value=value
        )
        calls.settle(store, scope, result)
    tracing.end_span(span, result.status)
    return result.status


def _on_task_failure(
    sender: Task | None = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    kwargs: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """In the worker's parent process: settle calls whose process was killed or died."""
    name = getattr(sender, "name", "") or ""
    if not name.startswith(k.TOOL_TASK_PREFIX) or not kwargs:
        return
    if not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    req = ToolTaskRequest.model_validate(kwargs)  # if it raises, Celery logs it

    def settle_killed() -> None:
        store = get_store()
        until = time.time() + get_settings().tool_grace_s + calls.HOLD_PAST_DEADLINE_S
        what = f"the end of killed call {req.call_id} ({req.tool})"
        key = k.turn_key(req.turn_id)
        raw = held_writes.hold(lambda: store.redis.hget(key, k.STARTED + req.call_id), until, what)
        start = json.loads(raw or "{}")
        # The fields of the start record, each None when it was never written.
        started, pid = start.get("started_at"), start.get("pid")
        scope = calls.CallScope(req, start.get("worker"), task_id, started, pid)
        if isinstance(exception, TimeLimitExceeded):
            result = scope.timeout(killed=True)
        else:
            why = f"its worker process died ({exception})"
            result = lost_result(scope.call, why, **scope.common)
        won = held_writes.hold(lambda: store.settle(req.turn_id, result), until, what)
        if won and tracing.enabled:
            # The child that ran the call died with its span: record it from here.
            tracing.record_settled(req.traceparent, req.turn_id, result, "worker")

    # On a thread: with Redis away the settle waits, and the pool's loop runs this handler.
    name = f"agentq-settle-{req.call_id}"
    threading.Thread(target=settle_killed, name=name, daemon=True).start()


def queues_of(specs: dict[str, ToolSpec], *, io: bool) -> list[str]:
    """The queues the tool worker (io=False) or the I/O worker (io=True) consumes."""
    queues: set[str] = {k.QUEUE_IO if io else k.QUEUE_TOOLS}
    queues.update(s.policy.queue for s in specs.values() if s.on_io_worker == io)
    return sorted(queues)


def register_tool_tasks(app: Celery, specs: dict[str, ToolSpec] | None = None) -> list[str]:
    """Register one task per tool on `app`; return the queues of the sync tools."""
    specs = specs if specs is not None else all_tools()
    for spec in specs.values():
        if spec.task_name in app.tasks:
            continue

        def make(s: ToolSpec) -> Any:
            def run(self: Task, **kwargs: Any) -> str:
                req = ToolTaskRequest.model_validate(kwargs)
                if s.on_io_worker:
                    from agentq.tools.aio_task import submit_call

                    return submit_call(self, s, req)
                return run_call(self, s, req)

            # Celery execs a `def` of this name: an MCP tool's name must not become source.
            run.__name__ = run.__qualname__ = "run_tool"
            run.__doc__ = s.description
            return run

        policy = spec.policy
        app.task(
            name=spec.task_name,
            bind=True,
            ignore_result=True,
            typing=False,
            # An idempotent call whose process died is re-run at once, not after Celery's 180 s.
            default_retry_delay=0,
            queue=policy.queue,
            # Calls on the event loop are acknowledged at hand-off: nothing to retry here.
            retry_on_worker_lost=policy.idempotent and not spec.on_io_worker,
            max_retries=policy.max_retries,
        )(make(spec))
    task_failure.connect(_on_task_failure, weak=False, dispatch_uid="agentq.tool.failure")
    return queues_of(specs, io=False)


@control_command(name=k.KILL_COMMAND, args=[("targets", list)], signature="[[task_id, pid], ...]")
def agentq_kill(state: Any, targets: list[list[Any]]) -> dict[str, Any]:
    """SIGKILL the pool processes still running these terminated tasks (the sweepers send it
    when an abort's kill grace is over): Celery forgets a task once it has terminated it, so
    a second revoke cannot escalate. A process that runs a task accepted since is spared."""
    pool = getattr(state.consumer, "pool", None)
    info = pool.info if pool is not None else {}
    ours = {int(p) for p in info.get("processes", ()) if p}
    busy = {r.worker_pid for r in worker_state.active_requests}
    killed = []
    for task_id, pid in targets:
        pid = int(pid)
        if pid == os.getpid() or pid not in ours or pid in busy:
            continue  # gone already, not ours, or running another task by now
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        log.warning("killed pool process %d: task %s outlived its SIGTERM", pid, task_id)
        killed.append(pid)
    return {"ok": f"killed {len(killed)}", "killed": killed}
