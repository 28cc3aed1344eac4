"""Bad input from the model: every bad call gets its own specific error result, a broken
stream a clear turn_error, and the turn and the workers keep working."""

from __future__ import annotations

import json

import pytest

from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import assert_gapless, assert_valid_history, calls

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]

# The bad call, and a phrase its error result must contain.
BAD_CALLS: list[tuple[ScriptedCall, str]] = [
    (ScriptedCall(name="echo", arguments='{"text": "unterminated'), "not valid JSON"),
    (ScriptedCall(name="echo", arguments="[1, 2]"), "must be a JSON object, got list"),
    (ScriptedCall(name="echo", arguments={"text": 5}), "text: Input should be a valid string"),
    (ScriptedCall(name="echo", arguments={}), "text: Field required"),
    (ScriptedCall(name="echo", arguments={"text": "a", "bogus": 1}), "bogus: Extra inputs"),
    (ScriptedCall(name="sleep", arguments={"seconds": "soon"}), "seconds: Input should be"),
    (ScriptedCall(name="nope", arguments={}), "unknown tool 'nope'"),
    (
        ScriptedCall(name="echo", arguments={"text": "a", "_meta": {"timeout_s": -1}}),
        "_meta.timeout_s must be a positive number",
    ),
    (ScriptedCall(name="echo", arguments={"text": "a", "_meta": 7}), "_meta must be an object"),
]


def _results(rig, turn_id: str) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    return {r["call_id"]: r for r in rig.client.get(turn_id)["invocations"]}


def _turn_works(rig) -> None:  # type: ignore[no-untyped-def]
    handle = rig.client._start_turn(
        rig.script(Round(tool_calls=calls(("echo", {"text": "still here"}))), Round(text="ok"))
    )
    assert rig.collect(handle.turn_id)[-1].type == "turn_finished"


def test_each_bad_call_gets_its_own_error_and_the_turn_goes_on(rig) -> None:
    good = ScriptedCall(name="echo", arguments={"text": "fine"})
    key = rig.script(
        Round(tool_calls=[c for c, _ in BAD_CALLS] + [good]),
        Round(text="Handled every error."),
    )
    handle = rig.client._start_turn(key)
    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["content"] == "Handled every error."
    assert_gapless(events)
    history = rig.client.get(handle.turn_id)["history"]
    assert_valid_history(history)
    tool_msgs = [m for m in history if m["role"] == "tool"]
    assert len(tool_msgs) == len(BAD_CALLS) + 1
    for (_, phrase), msg in zip(BAD_CALLS, tool_msgs, strict=False):
        body = json.loads(msg["content"])
        assert body["status"] == "error" and phrase in body["error"], (phrase, body)
    assert tool_msgs[-1]["content"] == "fine"
    # Bad calls never reached a worker: only the good one started.
    started = [e.fields["tool"] for e in events if e.type == "tool_started"]
    assert started == ["echo"]


def test_five_megabyte_arguments_are_refused_by_size(rig) -> None:
    huge = "x" * (5 * 1024 * 1024)
    key = rig.script(
        Round(tool_calls=calls(("echo", {"text": huge})), chunk_size=1 << 20),
        Round(text="Too big, noted."),
    )
    handle = rig.client._start_turn(key)
    events = rig.collect(handle.turn_id, timeout_s=60)
    assert events[-1].type == "turn_finished", events[-1]
    (result,) = _results(rig, handle.turn_id).values()
    assert result["status"] == "error"
    history = rig.client.get(handle.turn_id)["history"]
    body = json.loads(history[2]["content"])
    assert "over the limit of 1048576 bytes" in body["error"], body
    assert not [e for e in events if e.type == "tool_started"]
    _turn_works(rig)


def test_a_hundred_calls_in_one_round_stop_at_the_call_limit(rig) -> None:
    many = calls(*[("echo", {"text": f"n{i}"}) for i in range(100)])
    key = rig.script(Round(tool_calls=many, chunk_size=4096), Round(text="unreachable"))
    handle = rig.client._start_turn(key)
    events = rig.collect(handle.turn_id, timeout_s=60)
    assert events[-1].type == "turn_finished", events[-1]
    assert events[-1].fields["reason"] == "max_calls_per_turn"
    history = rig.client.get(handle.turn_id)["history"]
    assert_valid_history(history)
    statuses = [r["status"] for r in _results(rig, handle.turn_id).values()]
    assert statuses.count("ok") == 50 and statuses.count("error") == 50
    refused = [json.loads(m["content"]) for m in history[2:] if not m["content"].startswith("n")]
    assert len(refused) == 50
    assert all("max_calls_per_turn=50" in r["error"] for r in refused)
    assert_gapless(events)


def test_the_same_call_looping_is_stopped(rig) -> None:
    same = calls(("echo", {"text": "again"}))
    key = rig.script(*[Round(tool_calls=same) for _ in range(6)])
    handle = rig.client._start_turn(key)
    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_finished"
    assert events[-1].fields["reason"] == "loop_detected"
    history = rig.client.get(handle.turn_id)["history"]
    assert_valid_history(history)
    assert "loop detector" in json.loads(history[-1]["content"])["error"]


def test_a_malformed_stream_chunk_fails_the_turn_clearly(rig) -> None:
    key = rig.script(
        Round(text="This text is cut by a broken chunk.", fault="malformed", fault_after_chunks=2)
    )
    handle = rig.client._start_turn(key)
    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_error", events[-1]
    assert events[-1].fields["code"] == "EBADCHUNK"
    assert "malformed stream chunk" in events[-1].fields["error"]
    turn = rig.client.get(handle.turn_id)
    assert turn["state"]["status"] == "error" and turn["history"][-1]["role"] == "user"
    assert rig.llm.open_streams == 0
    _turn_works(rig)


def test_call_ids_the_model_garbles_or_reuses_are_replaced_consistently(rig) -> None:
    """Ids with unsafe characters, twice in a round, or reused from an earlier round get a
    fresh id in the history and in their result, so each call settles on its own and an
    approval can be answered by its request id."""
    from agentq.local.processes import wait_for
    from agentq.models import CALL_ID, REQUEST_ID

    key = rig.script(
        Round(
            tool_calls=[
                ScriptedCall(name="echo", arguments={"text": "a"}, id="call_0"),
                ScriptedCall(name="echo", arguments={"text": "b"}, id="call_0"),
                ScriptedCall(name="echo", arguments={"text": "c"}, id="../../x y"),
            ]
        ),
        Round(tool_calls=[ScriptedCall(name="delete_file", arguments={"path": "p"}, id="call_0")]),
        Round(text="done"),
    )
    handle = rig.client._start_turn(key)
    tid = handle.turn_id

    def requested() -> str | None:
        for e in rig.log_events(tid):
            if e.type == "interaction_requested":
                return str(e.fields["request_id"])
        return None

    wait_for(lambda: requested() is not None, 30, message="approval requested")
    request_id = requested()
    assert request_id is not None and REQUEST_ID.fullmatch(request_id), request_id
    rig.client.answer(tid, request_id, handle.token, "approve")
    events = rig.collect(tid)
    assert events[-1].type == "turn_finished", events[-1]
    assert_gapless(events)
    history = rig.client.get(tid)["history"]
    assert_valid_history(history)
    ids = [c["id"] for m in history if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert len(ids) == 4 and len(set(ids)) == 4 and all(CALL_ID.fullmatch(i) for i in ids), ids
    assert ids[0] == "call_0"  # a good id is kept
    tool_msgs = [m for m in history if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ids
    assert [m["content"] for m in tool_msgs] == ["a", "b", "c", "deleted p"]
