"""Bad input from clients (the Python API) and bad configuration: each gets a specific
error, and nothing else breaks. The HTTP variants live in tests/integration/test_gateway.py.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from pydantic import ValidationError

from agentq.config import load_settings
from agentq.errors import (
    ConfigError,
    InteractionClosed,
    InteractionNotFound,
    PayloadTooLarge,
    TokenInvalid,
    ToolDefinitionError,
    TurnNotFound,
)
from agentq.local.processes import run_process
from agentq.models import InteractionAnswer, TurnRequest
from agentq.testing.openai_server import Round
from agentq.tools.registry import tool, unregister
from tests.faults.rig import ROOT
from tests.helpers import assert_valid_history, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]

UNKNOWN = "0" * 32
DEAD_REDIS = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"prompt": 5}, "Input should be a valid string"),
        ({"prompt": "hi", "temperature": 2}, "Extra inputs are not permitted"),
        ({"prompt": "hi", "conversation_id": "no spaces!"}, "should match pattern"),
        ({"prompt": "hi", "conversation_id": "c" * 129}, "at most 128 characters"),
        ({"messages": "hello"}, "Input should be a valid list"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role must be one of"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": {"x": 1}}]}, "content must be text"),
        ({"prompt": "hi", "headless": "sometimes"}, "Input should be a valid boolean"),
    ],
)
def test_malformed_turn_requests_are_refused(fields: dict, phrase: str) -> None:
    with pytest.raises(ValidationError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        TurnRequest.model_validate(fields)


def test_client_errors_are_specific_and_the_turn_is_unharmed(rig) -> None:
    client = rig.client
    with pytest.raises(ValueError, match="needs a prompt or messages"):
        client._start_turn()
    limit = client.settings.max_prompt_bytes
    with pytest.raises(PayloadTooLarge) as too_big:
        client._start_turn("x" * (limit + 1))
    assert too_big.value.limit_bytes == limit and too_big.value.size_bytes > limit
    with pytest.raises(PayloadTooLarge):
        client._start_turn(messages=[{"role": "user", "content": "y" * limit}])
    for call in (
        lambda: client.abort(UNKNOWN, "token"),
        lambda: client.answer(UNKNOWN, "r", "token", "approve"),
        lambda: client.get(UNKNOWN),
        lambda: client.events(UNKNOWN),
    ):
        with pytest.raises(TurnNotFound):
            call()

    # A turn that waits for an approval with a half-second timeout.
    key = rig.script(Round(tool_calls=calls(("ask_quick", {"note": "n"}))), Round(text="ok"))
    handle = client._start_turn(key)
    tid = handle.turn_id
    asked = rig.collect(tid, until=lambda e: e.type == "interaction_requested")[-1]
    rid = asked.fields["request_id"]
    for bad in (None, "", "wrong", handle.token[:-1]):
        with pytest.raises(TokenInvalid):
            client.answer(tid, rid, bad, "approve")
        with pytest.raises(TokenInvalid):
            client.abort(tid, bad)
    with pytest.raises(InteractionNotFound):
        client.answer(tid, "no-such-request", handle.token, "approve")
    with pytest.raises(ValidationError):
        client.answer(tid, rid, handle.token, "maybe")
    with pytest.raises(ValidationError):
        InteractionAnswer(decision="approve", value="v" * 5000)

    events = rig.collect(tid)
    assert events[-1].type == "turn_finished", events[-1]
    types = [e.type for e in events]
    assert "interaction_timed_out" in types and "tool_denied" in types
    # The request expired: answering it now is refused as closed, not silently taken.
    with pytest.raises(InteractionClosed) as closed:
        client.answer(tid, rid, handle.token, "approve")
    assert closed.value.state == "timed_out"
    history = client.get(tid)["history"]
    assert_valid_history(history)
    assert '"reason": "timeout"' in history[2]["content"]
    # A finished turn cannot be aborted (not found), even with its token.
    with pytest.raises(TurnNotFound):
        client.abort(tid, handle.token)


def test_bad_settings_and_tool_declarations_name_what_is_wrong(monkeypatch) -> None:
    monkeypatch.setenv("AGENTQ_TOOL_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError) as exc:
        load_settings()
    assert exc.value.setting == "AGENTQ_TOOL_TIMEOUT_S"
    monkeypatch.setenv("AGENTQ_TOOL_TIMEOUT_S", "nan")
    with pytest.raises(ConfigError, match="AGENTQ_TOOL_TIMEOUT_S"):
        load_settings()
    monkeypatch.delenv("AGENTQ_TOOL_TIMEOUT_S")
    monkeypatch.setenv("AGENTQ_BROKER_URL", "http://example.org")
    with pytest.raises(ConfigError, match="AGENTQ_BROKER_URL"):
        load_settings()
    monkeypatch.delenv("AGENTQ_BROKER_URL")

    with pytest.raises(ToolDefinitionError, match="timeout_s"):
        tool(name="faults_negative", timeout_s=-1)(lambda: None)
    with pytest.raises(ToolDefinitionError, match=r"soft_timeout_s \(3\) must be below timeout_s"):
        tool(name="faults_soft_above_hard", timeout_s=2, soft_timeout_s=3)(lambda: None)
    with pytest.raises(ToolDefinitionError, match="finite approval_timeout_s"):
        tool(name="faults_endless_ask", approval="ask", approval_kind="device_code")(lambda: None)
    for name in ("faults_negative", "faults_soft_above_hard", "faults_endless_ask"):
        unregister(name)


def _agentq(*args: str, timeout_s: float = 60, **env: str) -> tuple[int, str, float]:
    """Run the agentq command; its exit code, its output, and how long it took."""
    t0 = time.monotonic()
    out = run_process(
        [sys.executable, "-m", "agentq", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout_s=timeout_s,
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def test_unreachable_broker_and_redis_fail_fast_with_a_clear_message(rig) -> None:
    code, out, took_s = _agentq("worker", "tools", AGENTQ_BROKER_URL=DEAD_REDIS)
    assert code == 2, out
    assert "AGENTQ_BROKER_URL: cannot reach redis://127.0.0.1:1/0" in out, out
    assert "Traceback" not in out and took_s < 20

    code, out, took_s = _agentq("run", "hello", AGENTQ_REDIS_URL="redis://:pw@127.0.0.1:1/0")
    assert code in (1, 2), out
    assert "AGENTQ_REDIS_URL: cannot reach redis://:**@127.0.0.1:1/0" in out, out
    assert "pw@" not in out and "Traceback" not in out and took_s < 20

    # A Cluster nobody answers for: named at start, not a traceback on the first step.
    code, out, took_s = _agentq("worker", "turns", AGENTQ_REDIS_CLUSTER_NODES="127.0.0.1:1")
    assert code == 2, out
    assert "AGENTQ_REDIS_CLUSTER_NODES: cannot reach 127.0.0.1:1" in out, out
    assert "Traceback" not in out and took_s < 30

    code, out, _ = _agentq("worker", "tools", AGENTQ_TOOL_TIMEOUT_S="-5")
    assert code == 2 and "AGENTQ_TOOL_TIMEOUT_S" in out and "Traceback" not in out, out
