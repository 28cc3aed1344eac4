"""The approval gate with real workers: finite waits, deny on silence, headless defaults."""

from __future__ import annotations

import json
import time

import pytest

from agentq.api import Client
from agentq.errors import InteractionClosed, InteractionNotFound
from agentq.fleet.runtime import get_store
from agentq.testing.openai_server import Round
from tests.helpers import assert_valid_history, calls, collect, script, wait_event

pytestmark = pytest.mark.integration


def test_approved_call_runs(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))),
        Round(text="deleted"),
    )
    h = client._start_turn(key)
    req = wait_event(client, h.turn_id, "interaction_requested")
    assert req.fields["kind"] == "approval" and req.fields["timeout_ms"] == 120_000
    assert "delete_file" in req.fields["prompt"]
    client.answer(h.turn_id, req.fields["request_id"], h.token, "approve")
    events = collect(client, h.turn_id)
    types = [e.type for e in events]
    assert types.index("interaction_answered") < types.index("tool_finished")
    done = next(e for e in events if e.type == "tool_finished")
    assert done.fields["status"] == "ok"
    assert events[-1].type == "turn_finished"
    with pytest.raises(InteractionClosed):  # answered already: 409 over HTTP
        client.answer(h.turn_id, req.fields["request_id"], h.token, "deny")


def test_user_denial_is_typed(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "/etc"}))),
        Round(text="ok, not deleting"),
    )
    h = client._start_turn(key)
    req = wait_event(client, h.turn_id, "interaction_requested")
    client.answer(h.turn_id, req.fields["request_id"], h.token, "deny")
    collect(client, h.turn_id)
    tool_msg = next(m for m in client.get(h.turn_id)["history"] if m["role"] == "tool")
    assert json.loads(tool_msg["content"]) == {
        "status": "denied",
        "decider": "mode_gate",
        "reason": "user",
    }


def test_ignored_approval_is_denied_on_timeout_and_late_answer_refused(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_quick", {"path": "a"}))),
        Round(text="it was denied"),
    )
    h = client._start_turn(key)
    t0 = time.monotonic()
    events = collect(client, h.turn_id)
    took = time.monotonic() - t0
    types = [e.type for e in events]
    for t in ("interaction_requested", "interaction_timed_out", "tool_denied", "turn_finished"):
        assert t in types, t
    assert "interaction_answered" not in types
    assert 0.9 < took < 10, took
    denied = next(e for e in events if e.type == "tool_denied")
    assert denied.fields["reason"] == "timeout"
    history = client.get(h.turn_id)["history"]
    assert_valid_history(history)
    tool_msg = next(m for m in history if m["role"] == "tool")
    assert json.loads(tool_msg["content"]) == {
        "status": "denied",
        "decider": "mode_gate",
        "reason": "timeout",
    }
    rid = next(e for e in events if e.type == "interaction_requested").fields["request_id"]
    with pytest.raises(InteractionClosed) as info:
        client.answer(h.turn_id, rid, h.token, "approve")
    assert info.value.state == "timed_out"
    with pytest.raises(InteractionNotFound):
        client.answer(h.turn_id, "no-such-request", h.token, "approve")


def test_headless_without_default_fails_at_once(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("delete_file", {"path": "x"}), ("echo", {"text": "never"}))),
    )
    h = client._start_turn(key, headless=True)
    t0 = time.monotonic()
    events = collect(client, h.turn_id)
    assert time.monotonic() - t0 < 10  # the 120 s approval timeout never elapses
    last = events[-1]
    assert last.type == "turn_error"
    assert last.fields["code"] == "headless_interaction" and last.fields["exit_code"] == 4
    assert not [e for e in events if e.type == "tool_started"]
    assert_valid_history(client.get(h.turn_id)["history"])


def test_headless_uses_the_declared_default(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("rm_rf", {"path": "/"}), ("forbidden", {}))),
        Round(text="denied, as declared"),
    )
    h = client._start_turn(key, headless=True)
    events = collect(client, h.turn_id)
    assert events[-1].type == "turn_finished"
    answered = next(e for e in events if e.type == "interaction_answered")
    assert answered.fields == {**answered.fields, "decision": "deny", "by": "default"}
    reasons = {e.fields["tool"]: e.fields["reason"] for e in events if e.type == "tool_denied"}
    assert reasons == {"rm_rf": "policy", "forbidden": "policy"}


def test_password_answer_never_stored(fleet, llm_server, client: Client, redis_server) -> None:
    secret = "hunter2-s3cr3t-value"
    key = script(
        llm_server, Round(tool_calls=calls(("login", {"user": "alice"}))), Round(text="logged in")
    )
    h = client._start_turn(key)
    req = wait_event(client, h.turn_id, "interaction_requested")
    assert req.fields["kind"] == "password"
    client.answer(h.turn_id, req.fields["request_id"], h.token, "approve", secret)
    events = collect(client, h.turn_id)
    result = next(e for e in events if e.type == "tool_finished")
    assert result.fields["status"] == "ok"
    tool_msg = next(m for m in client.get(h.turn_id)["history"] if m["role"] == "tool")
    assert tool_msg["content"] == "logged in alice"  # the tool did receive it
    r = get_store().redis
    leaks = []
    for k in r.scan_iter(count=1000):
        t = r.type(k).decode()
        if t == "string":
            vals = [r.get(k)]
        elif t == "hash":
            vals = list(r.hgetall(k).values())
        elif t == "list":
            vals = r.lrange(k, 0, -1)
        elif t == "stream":
            vals = [v for _, f in r.xrange(k) for v in f.values()]
        elif t in ("set", "zset"):
            vals = list(r.smembers(k)) if t == "set" else r.zrange(k, 0, -1)
        else:
            vals = []
        if any(secret.encode() in (v or b"") for v in vals):
            leaks.append(k)
    assert leaks == []
    for proc in fleet.values():
        assert secret not in proc.log_text()


def test_a_step_decides_from_the_request_records(agentq_env) -> None:
    """A step that takes over after a crash decides from the records: no second ask, no wait."""
    import uuid

    from agentq.config import get_settings
    from agentq.fleet.runtime import get_app
    from agentq.models import InteractionAnswer, InteractionRequest, ToolCall
    from agentq.orchestrator.approvals import gate
    from agentq.orchestrator.context import StepContext
    from agentq.orchestrator.plan import plan_call

    store = get_store()
    turn_id = uuid.uuid4().hex
    store.create(turn_id, {"status": "running"}, [{"role": "user", "content": "x"}])
    # This test is the step: hold the turn's lock so no turn worker steps it meanwhile.
    assert store.lock_step(turn_id, "test", 600_000)
    state = store.state(turn_id) or {}
    ctx = StepContext(turn_id, store, get_app(), get_settings(), "test", state, lock_ms=600_000)
    approve = ToolCall(id="a1", name="delete_file", arguments='{"path": "p"}')
    deny = ToolCall(id="d1", name="delete_file", arguments='{"path": "q"}')
    for call, decision in ((approve, "approve"), (deny, "deny")):
        store.open_interaction(
            turn_id,
            InteractionRequest(
                request_id=f"{call.id}.approval",
                kind="approval",
                call_id=call.id,
                tool=call.name,
                prompt="?",
                timeout_ms=120_000,
            ),
        )
        store.answer_interaction(
            turn_id, f"{call.id}.approval", InteractionAnswer(decision=decision)
        )
    t0 = time.monotonic()
    out = gate(ctx, [plan_call(approve), plan_call(deny)])
    assert time.monotonic() - t0 < 2  # decided from the records, no 120 s wait
    assert out.wait_until is None
    assert list(out.results) == ["d1"]
    assert out.results["d1"].status == "denied" and out.results["d1"].reason == "user"
    # Nothing was asked twice.
    assert not [e for e in store.bus.replay(turn_id) if e.type == "interaction_requested"]
