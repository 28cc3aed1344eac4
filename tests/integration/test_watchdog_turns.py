"""The stream watchdog's cases of the seeds, end to end: `agentq run` as a user runs it, a
real stream worker streaming from the scripted server, the turn's events as the user sees
them. The agent `t_watched` allows 1 s of silence and 4 s of streaming per turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli as agentq
from tests.helpers import script

pytestmark = pytest.mark.integration

IDLE_S = 1.0
ATTEMPTS = 3  # AGENTQ_LLM_MAX_RETRIES=2 in the test workers' settings


def run_json(env: dict[str, str], key: str) -> tuple[int, list[dict[str, Any]], float]:
    started = time.monotonic()
    out = agentq(env, "run", "--json", "--agent", "t_watched", key, timeout_s=90)
    events = [json.loads(line) for line in out.stdout.splitlines()]
    return out.returncode, events, time.monotonic() - started


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Round(text="never", fault="silent_after_200"), id="stall-before"),
        pytest.param(Round(text="never", fault="keepalive_only"), id="keepalive-only"),
    ],
)
def test_silence_before_any_chunk_fails_with_etimedout_after_its_retries(
    fleet: Any, llm_server: Any, agentq_env: dict[str, str], fault: Round
) -> None:
    key = script(llm_server, fault)
    code, events, elapsed_s = run_json(agentq_env, key)
    assert code == 1, events
    [error] = of(events, "turn_error")
    assert error["code"] == "ETIMEDOUT", error
    assert [e["attempt"] for e in of(events, "llm_retry")] == list(range(1, ATTEMPTS))
    assert sum(first_user(r) == key for r in llm_server.requests) == ATTEMPTS
    # About 3x the idle limit per attempt, with the backoffs and the fleet's hops.
    assert elapsed_s < ATTEMPTS * 3 * IDLE_S + 20, elapsed_s


@pytest.mark.parametrize("fault", ["silent_after_chunks", "keepalive_only"])
def test_silence_after_chunks_surfaces_without_a_retry(
    fleet: Any, llm_server: Any, agentq_env: dict[str, str], fault: str
) -> None:
    key = script(
        llm_server, Round(text="abcdefgh", chunk_size=2, fault=fault, fault_after_chunks=2)
    )
    code, events, elapsed_s = run_json(agentq_env, key)
    assert code == 1, events
    [error] = of(events, "turn_error")
    assert error["code"] == "ETIMEDOUT", error
    assert of(events, "llm_retry") == []
    assert "".join(e.get("text", "") for e in of(events, "llm_delta")) == "abcd"
    assert elapsed_s < 3 * IDLE_S + 20, elapsed_s


def test_a_trickle_under_the_idle_limit_meets_the_duration_budget(
    fleet: Any, llm_server: Any, agentq_env: dict[str, str]
) -> None:
    # A chunk every 0.5 s never trips the 1 s silence limit; 40 of them pass the 4 s budget.
    key = script(llm_server, Round(text="x" * 40, chunk_size=1, chunk_delay_ms=500))
    code, events, elapsed_s = run_json(agentq_env, key)
    assert code == 1, events
    [error] = of(events, "turn_error")
    assert error["code"] == "EDURATION", error
    assert of(events, "llm_retry") == []
    assert elapsed_s < 4 * 3 + 20, elapsed_s


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Round(text="never", fault="silent_after_200"), id="stall-before"),
        pytest.param(
            Round(text="abcd", chunk_size=2, fault="silent_after_chunks", fault_after_chunks=1),
            id="stall-after",
        ),
        pytest.param(Round(text="never", fault="keepalive_only"), id="keepalive-only"),
        pytest.param(Round(text="x" * 40, chunk_size=1, chunk_delay_ms=500), id="trickle"),
    ],
)
def test_ctrl_c_during_a_stalled_round_is_an_abort(
    fleet: Any, llm_server: Any, agentq_env: dict[str, str], fault: Round
) -> None:
    key = script(llm_server, fault)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentq", "run", "--json", "--agent", "t_watched", key],
        env={**os.environ, **agentq_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if json.loads(line)["type"] == "llm_started":
                break
        # Ctrl-C while the stream is open and silent (or trickling): the abort wins.
        while not any(first_user(r) == key for r in llm_server.requests):
            time.sleep(0.01)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = [json.loads(line) for line in proc.stdout]
        assert proc.wait(20) == 130, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() - sent < 10
        assert rest[-1]["type"] == "turn_aborted" and rest[-1]["reason"] == "user"
        assert of(rest, "turn_error") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def first_user(request: dict[str, Any]) -> str:
    from agentq.testing.openai_server import first_user_text

    return first_user_text(request["messages"])
