"""`celery -A agentq worker -Q ...` is as safe as `agentq worker KIND`: the queues decide the
worker's role, and with it the heartbeat and the pool rule."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentq.constants import WORKER_ALIVE_TTL_S, worker_alive_key
from agentq.local.processes import CELERY_READY_PATTERN, wait_for
from agentq.testing.openai_server import Round
from tests.faults.rig import ROOT, Rig
from tests.helpers import calls, starts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Nothing listens there: a refused worker must say why before it ever needs its broker.
NO_REDIS = "redis://127.0.0.1:1/0"


def bare_worker_argv(*opts: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "agentq", "worker", *opts]


def refused(*opts: str) -> str:
    """The output of a bare worker that must refuse to start, after checking it did."""
    env = {"AGENTQ_REDIS_URL": NO_REDIS, "PYTHONPATH": str(ROOT), "AGENTQ_TOOLS": ""}
    proc = subprocess.run(
        bare_worker_argv(*opts, "-l", "INFO"),
        env={**_inherited(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    return out


def _inherited() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_a_bare_tool_worker_refuses_a_pool_that_cannot_kill(pool: str) -> None:
    out = refused("-Q", "agentq.tools", "-P", pool)
    assert "the tool worker needs the prefork pool" in out, out


def test_a_bare_worker_of_every_queue_is_refused_with_the_queues_by_role() -> None:
    # Without -Q Celery would consume every queue on one pool: tools on threads, turns
    # on prefork; agentq names the roles and the way out instead.
    out = refused()
    assert "one role" in out and "tools: agentq.tools" in out and "turns: agentq.turns" in out
    out = refused("-Q", "agentq.tools,somebody.else")
    assert "not a queue of agentq: somebody.else" in out, out


def test_a_bare_tool_worker_beats_and_its_death_settles_the_call_lost(tmp_path: Path) -> None:
    rig = Rig("bare-celery")
    try:
        rig.start("llm", "turns")
        hostname = f"bare-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        worker = rig.fleet.start(
            hostname.split("@")[0],
            bare_worker_argv("-Q", "agentq.tools", "-n", hostname, "-c", "2", "-l", "INFO"),
            ready_pattern=CELERY_READY_PATTERN,
            ready_timeout_s=60,
            cwd=ROOT,
        )
        assert "agentq tools worker: consuming agentq.tools" in worker.log_text()
        redis = rig.client._store.redis
        wait_for(lambda: redis.exists(worker_alive_key(hostname)), 10, message="a heartbeat")

        count = tmp_path / "count"
        key = rig.script(
            Round(tool_calls=calls(("counted_unlimited", {"path": str(count)}))),
            Round(text="Went on without it."),
        )
        handle = rig.client._start_turn(key)
        wait_for(lambda: starts(count) == 1, 15, message="the unlimited tool to start")
        record = rig.client._store.call_progress(handle.turn_id)[0]
        assert [r.get("heartbeat") for r in record.values()] == [True], record
        worker.kill()  # the whole process group: nobody is left to report the call
        killed_at = time.time()
        events = rig.collect(handle.turn_id, timeout_s=30)
        assert events[-1].type == "turn_finished", events[-1]
        lost = next(e for e in events if e.type == "tool_finished")
        assert lost.fields["status"] == "lost" and "heartbeat" in lost.fields["error"]
        # A tool with no hard limit: only the missing beat can have settled it this soon.
        assert lost.ts - killed_at < WORKER_ALIVE_TTL_S + 6.0, lost.ts - killed_at
    finally:
        rig.close()
