"""`agentq --version`, every subcommand's `--help` with nothing running, `agentq answer`."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import agentq
from agentq.api import Client
from agentq.local.processes import run_process
from agentq.testing.openai_server import Round
from tests.helpers import calls, collect, script, wait_event

pytestmark = pytest.mark.integration

# Nothing listens there: help must not need Redis, the broker or anything else.
NOTHING = {"AGENTQ_REDIS_URL": "redis://127.0.0.1:1/0"}

HELP_SHOWS = {
    ("run",): ["--headless", "--json"],
    ("abort",): ["--token"],
    ("turns",): ["--json", "--watch", "--status"],
    ("show",): ["turn_id", "--json"],
    ("answer",): ["{approve,deny}", "--value", "--token"],
    ("events",): ["--after"],
    ("waitpoint", "complete"): ["waitpoint_id", "--token", "--json", "--error"],
    ("serve",): ["--insecure-no-auth", "--port"],
    ("dev",): ["--no-flower", "--once"],
    ("worker",): ["turns", "tools", "io", "llm", "--concurrency"],
    # Celery's own worker options, passed through.
    ("worker", "turns"): ["--concurrency", "--hostname", "--queues", "--pool"],
    ("worker", "llm"): ["--concurrency", "--loglevel"],
    ("worker", "tools"): ["--concurrency", "--max-tasks-per-child", "--autoscale"],
    ("worker", "io"): ["--concurrency", "--hostname"],
    # Flower's own options, passed through.
    ("flower",): ["--basic-auth", "--port", "--address", "--url-prefix", "--persistent"],
}


def agentq_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
    return run_process(
        [sys.executable, "-m", "agentq", *args], env={**base, **(env or NOTHING)}, timeout_s=90
    )


def test_version() -> None:
    out = agentq_cmd("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"agentq {agentq.__version__}"


def test_every_subcommands_help_works_with_nothing_running() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(
            zip(HELP_SHOWS, pool.map(lambda c: agentq_cmd(*c, "--help"), HELP_SHOWS), strict=True)
        )
    for cmd, shows in HELP_SHOWS.items():
        out = results[cmd]
        text = out.stdout + out.stderr
        assert out.returncode == 0, (cmd, text)
        assert "Traceback" not in text and "cannot reach" not in text, (cmd, text)
        missing = [s for s in shows if s not in out.stdout]
        assert not missing, (cmd, missing, out.stdout)
    # Flower's random per-process cookie secret is not printed.
    assert "--cookie-secret                  secure cookie secret\n" in results[("flower",)].stdout


def test_answer_approves_a_pending_call_from_the_terminal(
    fleet, llm_server, client: Client, agentq_env: dict[str, str]
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))),
        Round(text="Done."),
    )
    h = client._start_turn(key)
    req = wait_event(client, h.turn_id, "interaction_requested")
    rid = str(req.fields["request_id"])
    shown = agentq_cmd("show", h.turn_id, env=agentq_env)
    assert f"agentq answer {h.turn_id} {rid} approve|deny" in shown.stdout, shown.stdout
    wrong = agentq_cmd("answer", h.turn_id, "nope", "approve", env=agentq_env)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    # As `agentq turns` shows the turn: its first 12 characters name it.
    out = agentq_cmd("answer", h.turn_id[:12], rid, "approve", env=agentq_env)
    assert out.returncode == 0 and f"approved {rid} of {h.turn_id}" in out.stdout, out.stderr
    events = collect(client, h.turn_id)
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["ok"]
    again = agentq_cmd("answer", h.turn_id, rid, "deny", env=agentq_env)
    assert again.returncode == 1, again.stdout
