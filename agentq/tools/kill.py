"""The tool worker's side of an abort's SIGKILL escalation: a remote control command.

An abort sends SIGTERM through Celery's revoke; a tool that ignores it keeps its pool
process. Celery drops a task from its active requests once it has terminated it, so the
escalation cannot be a second revoke: the turn workers' sweepers send this command with
the task ids and pool process ids from the calls' start records, when the kill grace is
over. A process is killed only while it is still one of this worker's pool processes and
no task it has accepted since is running on it.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from celery.worker import state as worker_state
from celery.worker.control import control_command

from agentq import constants as k

log = logging.getLogger("agentq.tools")


@control_command(
    name=k.KILL_COMMAND,
    args=[("targets", list)],
    signature="[[task_id, pid], ...]",
)
def agentq_kill(state: Any, targets: list[list[Any]]) -> dict[str, Any]:
    """SIGKILL the pool processes still running these terminated tasks."""
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
