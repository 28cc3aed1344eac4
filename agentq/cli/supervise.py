"""`agentq worker llm|io`: N Celery workers under one command, one event loop (one core)
each, and a fresh one started when a worker recycles itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from agentq.cli.options import take_option
from agentq.errors import ConfigError

SUPERVISED_ENV = "AGENTQ_SUPERVISED"
"""Set in the workers a supervisor starts, so they run Celery instead of supervising."""
PROCESSES_OPTION = "--processes"
MAX_AUTO_PROCESSES = 4
"""The most `agentq worker llm` starts by default (one per CPU): each costs ~150 MB, 20
Redis connections."""


def default_processes(kind: str) -> int:
    if kind != "llm":
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_AUTO_PROCESSES))


def take_processes(opts: Sequence[str], setting: int) -> tuple[list[str], int | None]:
    """`--processes N` out of the Celery options: (the rest, N, else `setting` or None)."""
    value, rest = take_option(opts, PROCESSES_OPTION)
    if value is None:
        return rest, setting or None
    n = int(value) if value.isdigit() else 0
    if not 1 <= n <= 64:
        raise ConfigError(PROCESSES_OPTION, f"must be a whole number from 1 to 64, not {value!r}")
    return rest, n


def child_opts(kind: str, opts: Sequence[str], index: int, processes: int) -> list[str]:
    """Worker `index`'s options: with several, each its own node name (`llm-1@%h`, ...),
    which Celery needs for revokes and Flower."""
    if processes == 1:
        return list(opts)
    name, rest = take_option(opts, "-n", "--hostname")
    node, at, host = (name or f"{kind}@%h").partition("@")
    return [*rest, "--hostname", f"{node}-{index + 1}{at}{host}"]


def _die_with_parent() -> None:
    """In each worker, before exec: SIGTERM (warm) when the supervisor is killed outright."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(kind: str, opts: Sequence[str], processes: int) -> int:
    """Run `processes` workers of `kind`, starting again one that recycled itself; any other
    exit stops the rest (SIGTERM: warm) and ends the supervisor with its code."""
    from agentq.constants import RECYCLE_EXIT_CODE

    env = {**os.environ, SUPERVISED_ENV: "1"}
    argvs = [
        [sys.executable, "-m", "agentq", "worker", kind, *child_opts(kind, opts, i, processes)]
        for i in range(processes)
    ]
    # pid -> (index of its argv, its Popen), kept: a Popen dropped while its worker runs
    # is listed for subprocess to reap, and the next Popen would reap it unseen by os.wait().
    running: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
    stopping = False

    def start(i: int) -> None:
        # In a session of its own: a terminal's Ctrl-C reaches the supervisor alone, which
        # passes it on once (a second SIGINT is Celery's cold shutdown: tasks killed).
        proc = subprocess.Popen(
            argvs[i], env=env, preexec_fn=_die_with_parent, start_new_session=True
        )
        running[proc.pid] = i, proc

    def stop_all(signum: int, _frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_all)
    for i in range(processes):
        start(i)
    first_rc: int | None = None
    while running:
        pid, status = os.wait()
        if pid not in running:
            continue
        i, proc = running.pop(pid)
        rc = proc.returncode = os.waitstatus_to_exitcode(status)
        if rc == RECYCLE_EXIT_CODE and not stopping:
            print(
                f"agentq: a {kind} worker recycled itself (blocked event loop); restarting",
                file=sys.stderr,
                flush=True,
            )
            start(i)
            continue
        if first_rc is None:
            first_rc = rc
        if not stopping:
            stop_all(signal.SIGTERM)
    return first_rc or 0
