"""Conversations through real workers: one turn at a time, each multitask policy, appends
that lose nothing, idempotent starts, and the conversation as a resource."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest

from agentq import constants as k
from agentq.api import Client
from agentq.errors import ConversationBusy, ConversationNotFound, IdempotencyKeyReused
from agentq.events import Event
from agentq.local.processes import wait_for
from agentq.models import TurnRequest
from agentq.state.store import TurnStore
from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli, assert_valid_history, calls, collect, script

pytestmark = pytest.mark.integration


def conv_id() -> str:
    return f"c-{uuid.uuid4().hex[:12]}"


def until_type(type_: str, **fields: object):
    def match(ev: Event) -> bool:
        return ev.type == type_ and all(ev.fields.get(f) == v for f, v in fields.items())

    return match


def user_texts(history: list[dict]) -> list[str]:
    return [str(m["content"]) for m in history if m["role"] == "user"]


def test_a_second_message_waits_for_the_first_and_both_are_kept(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("sleep", {"seconds": 1.0}))),
        Round(text="first answer"),
        Round(text="second answer"),
    )
    conv = conv_id()
    first = client._start_turn(f"{key} one", conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    second = client._start_turn("two", conversation_id=conv, operator=True)
    assert second.queued is True and second.position == 1 and second.behind == first.turn_id
    assert client.conversation(conv, operator=True)["status"] == "busy"
    events = collect(client, second.turn_id)
    assert events[0].type == "turn_queued"
    assert events[0].fields == {"position": 1, "behind": first.turn_id}
    assert events[1].type == "turn_started" and events[-1].type == "turn_finished"
    assert events[-1].fields["content"] == "second answer"
    first_end = collect(client, first.turn_id)[-1]
    assert first_end.type == "turn_finished"
    # Each counts its own rounds, not the ones of the turns before it.
    assert first_end.fields["rounds"] == 2 and events[-1].fields["rounds"] == 1
    # The second ran after the first had ended, on the history it left.
    assert events[1].ts >= first_end.ts
    view = client.conversation(conv, operator=True)
    assert view["status"] == "idle" and view["running_turn_id"] is None and view["queued"] == []
    history = view["messages"]
    assert user_texts(history) == [f"{key} one", "two"]
    assert [m["role"] for m in history] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert_valid_history(history)
    # The third turn is sent the whole conversation.
    third = client._start_turn("three", conversation_id=conv, operator=True)
    collect(client, third.turn_id)
    assert user_texts(client.get(third.turn_id)["history"]) == [f"{key} one", "two", "three"]


def test_reject_answers_busy_and_stores_nothing(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 1.0}))), Round(text="ok"))
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    with pytest.raises(ConversationBusy) as err:
        client._start_turn("again", conversation_id=conv, operator=True, multitask="reject")
    assert err.value.running_turn_id == first.turn_id
    assert err.value.code == "conversation_busy"
    assert client.conversation(conv, operator=True)["queued"] == []
    collect(client, first.turn_id)
    assert user_texts(client.conversation(conv, operator=True)["messages"]) == [key]


def test_interrupt_aborts_the_running_turn_and_keeps_what_it_settled(
    fleet, llm_server, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("echo", {"text": "kept"}), ("hang", {"seconds": 60}))),
        Round(text="after interrupt"),
    )
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_finished", tool="echo"))
    second = client._start_turn(
        "stop that", conversation_id=conv, operator=True, multitask="interrupt"
    )
    aborted = collect(client, first.turn_id)[-1]
    assert aborted.type == "turn_aborted" and aborted.fields["reason"] == "interrupt"
    assert collect(client, second.turn_id)[-1].type == "turn_finished"
    history = client.conversation(conv, operator=True)["messages"]
    assert_valid_history(history)
    tools = {m["tool_call_id"]: m["content"] for m in history if m["role"] == "tool"}
    assert "kept" in tools.values()
    assert user_texts(history) == [key, "stop that"]


def test_rollback_drops_the_running_turns_exchange(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(text="first"),
        Round(tool_calls=calls(("hang", {"seconds": 60}))),
        Round(text="rolled"),
    )
    conv = conv_id()
    collect(client, client._start_turn(key, conversation_id=conv, operator=True).turn_id)
    doomed = client._start_turn("do the slow thing", conversation_id=conv, operator=True)
    collect(client, doomed.turn_id, until=until_type("tool_started"))
    # The scripted model counts assistant messages: without the rolled back exchange the
    # next request is its round 1 again, so script that round's answer for the new turn.
    llm_server.set_script(key, [Round(text="first"), Round(text="rolled")])
    newer = client._start_turn(
        "never mind", conversation_id=conv, operator=True, multitask="rollback"
    )
    assert collect(client, doomed.turn_id)[-1].fields["reason"] == "rollback"
    assert collect(client, newer.turn_id)[-1].fields["content"] == "rolled"
    history = client.conversation(conv, operator=True)["messages"]
    assert user_texts(history) == [key, "never mind"]
    assert_valid_history(history)


def test_inject_joins_the_running_turn_at_its_next_round(fleet, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("sleep", {"seconds": 1.0}))),
        Round(text="saw both"),
    )
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    joined = client._start_turn(
        "also check X", conversation_id=conv, operator=True, multitask="inject"
    )
    assert joined.injected is True and joined.turn_id == first.turn_id
    assert joined.message_turn_id and joined.message_turn_id != first.turn_id
    events = collect(client, first.turn_id)
    injected = [e for e in events if e.type == "message_injected"]
    assert [e.fields["message_turn_id"] for e in injected] == [joined.message_turn_id]
    assert events[-1].type == "turn_finished"
    history = client.get(first.turn_id)["history"]
    roles = [m["role"] for m in history]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]
    assert history[3]["content"] == "also check X"
    # Its own turn ended, pointing at the turn that took its message.
    own = collect(client, joined.message_turn_id)[-1]
    assert own.type == "turn_finished" and own.fields["into"] == first.turn_id
    conv_history = client.conversation(conv, operator=True)["messages"]
    assert conv_history == history
    assert client.conversation(conv, operator=True)["queued"] == []


def test_an_inject_the_turn_cannot_take_runs_as_the_next_turn(
    fleet, llm_server, client: Client
) -> None:
    # One slow round and no tool calls: no later round for the message to join.
    key = script(llm_server, Round(text="a slow only answer " * 4, chunk_delay_ms=80, chunk_size=4))
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("llm_delta"))
    joined = client._start_turn(
        "late addition", conversation_id=conv, operator=True, multitask="inject"
    )
    assert joined.injected is True
    events = collect(client, str(joined.message_turn_id))
    assert events[-1].type == "turn_finished"
    assert all(e.type != "message_injected" for e in collect(client, first.turn_id))
    assert user_texts(client.conversation(conv, operator=True)["messages"]) == [
        key,
        "late addition",
    ]


def test_idempotent_starts_return_the_first_turn(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(text="once"))
    ikey = f"idem-{uuid.uuid4().hex}"
    handles = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            handles.append(client._start_turn(key, idempotency_key=ikey))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len({(h.turn_id, h.token) for h in handles}) == 1 and len(handles) == 12
    collect(client, handles[0].turn_id)
    assert client._start_turn(key, idempotency_key=ikey).turn_id == handles[0].turn_id
    with pytest.raises(IdempotencyKeyReused):
        client._start_turn(key + " different", idempotency_key=ikey)
    with pytest.raises(ValueError, match="Idempotency-Key"):
        client._start_turn(key, idempotency_key="")
    with pytest.raises(ValueError, match="255"):
        client._start_turn(key, idempotency_key="k" * 256)


def test_delete_aborts_its_turns_and_removes_it(fleet, llm_server, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    conv = conv_id()
    running = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, running.turn_id, until=until_type("tool_started"))
    queued = client._start_turn("later", conversation_id=conv, operator=True)
    listed = {c["conversation_id"]: c for c in client.conversations(operator=True, limit=200)}
    assert listed[conv]["status"] == "busy" and listed[conv]["running_turn_id"] == running.turn_id
    assert listed[conv]["queued"] == 1
    removed = client.delete_conversation(conv, operator=True)
    assert removed == [running.turn_id, queued.turn_id]
    assert collect(client, running.turn_id)[-1].type == "turn_aborted"
    assert collect(client, queued.turn_id)[-1].type == "turn_aborted"
    with pytest.raises(ConversationNotFound):
        client.conversation(conv, operator=True)


def test_another_owners_conversation_is_not_found(fleet, llm_server, client: Client) -> None:
    conv = conv_id()
    req = TurnRequest(prompt=script(llm_server, Round(text="mine")), conversation_id=conv)
    handle = client._start_turn(req, owner="alice")
    collect(client, handle.turn_id)
    with pytest.raises(ConversationNotFound):
        client.conversation(conv, owner="bob")
    assert client.conversation(conv, owner="alice")["status"] == "idle"
    assert conv not in [c["conversation_id"] for c in client.conversations(owner="bob")]
    assert conv in [c["conversation_id"] for c in client.conversations(owner="alice")]


def test_the_cli_queues_a_message_and_shows_the_conversation(
    fleet, llm_server, agentq_env, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("hang", {"seconds": 60}))),
        Round(text="two"),
        Round(text="x"),
    )
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    argv = ["run", "--conversation", conv, "--idempotency-key", "k1", "two"]
    with subprocess.Popen(
        [sys.executable, "-m", "agentq", *argv],
        env={**os.environ, **agentq_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as proc:
        # Queued behind the hanging turn; once that one is aborted, it runs.
        wait_for(lambda: client.conversation(conv, operator=True)["queued"], 30, 0.05)
        client.abort(first.turn_id, None, operator=True)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert f"queued behind turn {first.turn_id}" in stdout and "two" in stdout
    # The same key again: the first run's turn, not a third exchange.
    again = agentq_cli(
        agentq_env, "run", "--json", "--conversation", conv, "--idempotency-key", "k1", "two"
    )
    assert again.returncode == 0, again.stderr
    busy = agentq_cli(
        agentq_env, "run", "--conversation", conv, "--multitask", "reject", "x", timeout_s=30
    )
    assert busy.returncode == 0  # idle by now: reject runs it
    shown = agentq_cli(agentq_env, "conversations", "show", conv, "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert user_texts(view["messages"]) == [key, "two", "x"]
    listed = agentq_cli(agentq_env, "conversations", "--limit", "200")
    assert conv in listed.stdout
    gone = agentq_cli(agentq_env, "conversations", "delete", conv)
    assert gone.returncode == 0 and f"deleted {conv}" in gone.stdout
    missing = agentq_cli(agentq_env, "conversations", "show", conv)
    assert missing.returncode == 1 and "unknown or not yours" in missing.stderr
    no_id = agentq_cli(agentq_env, "conversations", "show")
    assert no_id.returncode == 2 and "needs a conversation id" in no_id.stderr
    bad = agentq_cli(agentq_env, "run", "--conversation", conv, "--multitask", "queue", "x")
    assert bad.returncode == 2 and "enqueue" in bad.stderr


def test_an_aborted_queued_turn_leaves_the_queue_and_its_message_is_not_kept(
    fleet, llm_server, client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 1.5}))), Round(text="a"))
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    waiting = client._start_turn("never mind this", conversation_id=conv, operator=True)
    assert client.conversation(conv, operator=True)["queued"] == [waiting.turn_id]
    # The console's listing says it waits for its conversation.
    from agentq.fleet import runtime
    from agentq.state.listing import TurnLister

    rows = TurnLister(runtime.get_store().redis).summaries([waiting.turn_id, first.turn_id])
    assert rows[waiting.turn_id]["conversation_waiting"] is True
    assert rows[waiting.turn_id]["conversation_id"] == conv
    assert rows[first.turn_id]["conversation_waiting"] is False
    client.abort(waiting.turn_id, waiting.token)
    assert collect(client, waiting.turn_id)[-1].type == "turn_aborted"
    # The queue entry goes in the hand-off, the ending step's write after turn_aborted.
    wait_for(lambda: client.conversation(conv, operator=True)["queued"] == [], 10, 0.05)
    assert collect(client, first.turn_id)[-1].type == "turn_finished"
    view = client.conversation(conv, operator=True)
    assert view["status"] == "idle" and user_texts(view["messages"]) == [key]


def _end_without_hand_off(client: Client, store: TurnStore, turn_id: str) -> None:
    """Write a turn's end (its running call answered), as by a step whose process then
    died before its hand-off: nothing hands the conversation on."""
    from agentq.models import TurnStatus

    call_id = client.get(turn_id)["history"][-1]["tool_calls"][0]["id"]
    answered = {"role": "tool", "tool_call_id": call_id, "content": "cancelled"}
    store.close(
        turn_id,
        TurnStatus.ABORTED,
        "turn_aborted",
        {"reason": "user"},
        append=[answered],
        hands_off=True,
    )


def test_a_turn_that_ended_without_handing_off_does_not_strand_the_one_behind(
    fleet, llm_server, client: Client
) -> None:
    from agentq.fleet import runtime
    from agentq.models import TurnStatus
    from agentq.orchestrator.conversation import conversations

    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))), Round(text="b"))
    conv = conv_id()
    first = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, first.turn_id, until=until_type("tool_started"))
    behind = client._start_turn("next", conversation_id=conv, operator=True)
    store = runtime.get_store()
    _end_without_hand_off(client, store, first.turn_id)
    # Read from storage: `Client.conversation` shows it as handed off (the test below).
    assert conversations(store).view(conv).running_turn_id == first.turn_id
    # The queued turn's next look (its wakeup, brought forward) releases it and runs.
    store.wake_by(behind.turn_id, 0)
    end = collect(client, behind.turn_id, timeout_s=30)[-1]
    assert end.type == "turn_finished"
    view = client.conversation(conv, operator=True)
    assert view["status"] == "idle" and user_texts(view["messages"]) == [key, "next"]
    assert_valid_history(view["messages"])
    # A turn that ended without a hand-off and with nobody queued: the next start finds
    # it, hands off for it, and runs at once.
    conv2 = conv_id()
    lone = client._start_turn(key, conversation_id=conv2, operator=True)
    collect(client, lone.turn_id, until=until_type("tool_started"))
    store.close(lone.turn_id, TurnStatus.ABORTED, "turn_aborted", {"reason": "user"})
    after = client._start_turn("again", conversation_id=conv2, operator=True)
    assert not after.queued
    assert collect(client, after.turn_id)[-1].type == "turn_finished"


def test_reading_a_conversation_whose_turn_ended_shows_its_exchange(
    fleet, llm_server, client: Client
) -> None:
    from agentq.fleet import runtime
    from agentq.orchestrator.conversation import conversations

    # A turn's end is written before its exchange is appended: a reader that saw the end
    # (here the end alone, as if its step stopped between the two) is shown the exchange.
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))), Round(text="b"))
    conv = conv_id()
    turn = client._start_turn(key, conversation_id=conv, operator=True)
    collect(client, turn.turn_id, until=until_type("tool_started"))
    store = runtime.get_store()
    _end_without_hand_off(client, store, turn.turn_id)
    assert conversations(store).view(conv).running_turn_id == turn.turn_id
    view = client.conversation(conv, operator=True)
    assert view["status"] == "idle" and view["running_turn_id"] is None
    assert user_texts(view["messages"]) == [key]
    assert_valid_history(view["messages"])
    # The read wrote nothing: the conversation is still held by the ended turn ...
    stored = conversations(store).view(conv)
    assert stored.running_turn_id == turn.turn_id and stored.messages == []
    # ... until the wakeup its end left comes due (nobody reads, nobody starts a turn):
    # its step hands the conversation on, and takes the wakeup away.
    handed = wait_for(
        lambda: (v := conversations(store).view(conv)).running_turn_id is None and v,
        30,
        message="the ended turn's backstop wakeup never handed its conversation on",
    )
    assert user_texts(handed.messages) == [key]
    # The hand-off takes the wakeup away just after its release script: waited for too.
    wait_for(
        lambda: store.redis.zscore(k.shard_key(k.WAKEUPS, turn.turn_id), turn.turn_id) is None,
        30,
        message="the hand-off left the ended turn's backstop wakeup behind",
    )
