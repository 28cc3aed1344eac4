"""`agentq run` and friends as a user runs them: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from agentq.local.processes import run_process, wait_for
from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli as agentq
from tests.helpers import calls, script

pytestmark = pytest.mark.integration


def test_run_json_prints_events_and_exits_0(fleet, llm_server, agentq_env) -> None:
    key = script(
        llm_server, Round(text="Hi.", tool_calls=calls(("echo", {"text": "x"}))), Round(text="Bye.")
    )
    out = agentq(agentq_env, "run", "--json", key)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["type"] == "turn_started" and events[-1]["type"] == "turn_finished"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))


def test_run_renders_live_and_summarises(fleet, llm_server, agentq_env) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("echo", {"text": "x"}), ("fail", {"message": "bad"}))),
        Round(text="Answer text here."),
    )
    out = agentq(agentq_env, "run", key)
    assert out.returncode == 0, out.stderr
    assert "Answer text here." in out.stdout
    assert "echo" in out.stdout and "fail" in out.stdout
    assert "turn finished" in out.stdout and "1 error" in out.stdout and "1 ok" in out.stdout


def test_headless_interaction_exits_4(fleet, llm_server, agentq_env) -> None:
    key = script(llm_server, Round(tool_calls=calls(("delete_file", {"path": "x"}))))
    t0 = time.monotonic()
    out = agentq(agentq_env, "run", "--headless", "--json", key)
    assert out.returncode == 4, (out.stdout, out.stderr)
    assert time.monotonic() - t0 < 30


def test_model_error_exits_1(fleet, llm_server, agentq_env) -> None:
    key = script(llm_server, Round(fault="http_400"))
    out = agentq(agentq_env, "run", "--json", key)
    assert out.returncode == 1
    assert json.loads(out.stdout.splitlines()[-1])["type"] == "turn_error"


def test_ctrl_c_aborts_the_turn_for_real(fleet, llm_server, agentq_env) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentq", "run", "--json", key],
        env={**os.environ, **agentq_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        pid = None
        for line in proc.stdout:
            ev = json.loads(line)
            if ev["type"] == "tool_started":
                pid = int(ev["pid"])
                break
        assert pid and psutil.pid_exists(pid)
        proc.send_signal(signal.SIGINT)
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(20) == 130
        assert rest[-1]["type"] == "turn_aborted" and rest[-1]["reason"] == "user"
        wait_for(lambda: not psutil.pid_exists(pid), 5, message="tool process gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_events_turns_and_operator_abort(fleet, llm_server, agentq_env) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    from agentq.api import Client

    client = Client()
    h = client._start_turn(key)
    wait_for(
        lambda: any(t["turn_id"] == h.turn_id and t["current_tools"] for t in client.active()),
        20,
        message="turn running a tool",
    )
    listed = json.loads(agentq(agentq_env, "turns", "--json").stdout)["turns"]
    mine = next(t for t in listed if t["turn_id"] == h.turn_id)
    assert mine["current_tools"][0]["tool"] == "hang"
    out = agentq(agentq_env, "abort", h.turn_id)
    assert out.returncode == 0, out.stderr
    events = agentq(agentq_env, "events", h.turn_id)
    types = [json.loads(line)["type"] for line in events.stdout.splitlines()]
    assert types[0] == "turn_started" and types[-1] == "turn_aborted"
    again = agentq(agentq_env, "abort", h.turn_id)
    assert again.returncode == 1 and "unknown or already finished" in again.stderr


def test_bad_config_fails_at_start_naming_the_setting(agentq_env) -> None:
    out = agentq({**agentq_env, "AGENTQ_TOOL_TIMEOUT_S": "-5"}, "turns")
    assert out.returncode == 2
    assert "AGENTQ_TOOL_TIMEOUT_S" in out.stderr and "Traceback" not in out.stderr


def test_tool_worker_refuses_a_pool_that_cannot_enforce_hard_limits(agentq_env) -> None:
    out = agentq(agentq_env, "worker", "tools", "-P", "threads")
    assert out.returncode == 2
    assert "prefork" in out.stderr and "hard time limits" in out.stderr


def test_worker_entry_points_take_celery_options(agentq_env) -> None:
    for kind in ("turns", "llm", "tools", "io"):
        out = run_process(
            [sys.executable, "-m", f"workers.{kind}", "--help"], env={**os.environ, **agentq_env}
        )
        assert out.returncode == 0, out.stderr
        assert "--concurrency" in out.stdout  # Celery's own worker options
    bad = run_process(
        [sys.executable, "-m", "workers.tools", "-P", "solo"], env={**os.environ, **agentq_env}
    )
    assert bad.returncode == 2 and "prefork" in bad.stderr
