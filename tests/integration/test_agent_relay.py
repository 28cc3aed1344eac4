"""Sub-agents in the parent's stream: relayed events over SSE, resuming, approvals asked by
a child and answered from the parent's stream, and who may read or answer them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.config import load_settings
from agentq.events import Event
from agentq.gateway import create_app
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from agentq.testing.sse import SSEMessage, iter_sse
from tests.helpers import calls, collect, script, script_asking_echoer, wait_event

pytestmark = pytest.mark.integration

ALICE_KEY = "alice-" + secrets.token_urlsafe(24)
BOB_KEY = "bob-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    settings = load_settings(
        api_keys=f"alice={ALICE_KEY},bob={BOB_KEY}", start_burst=1000, start_rate_per_s=100.0
    )
    with BackgroundServer(create_app(Client(settings))) as server:
        yield server


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse(http: httpx.Client, turn_id: str, key: str, **params: Any) -> list[SSEMessage]:
    """The whole stream of an ended turn (the gateway ends it after the terminal event)."""
    headers = auth(key)
    if "last_event_id" in params:
        headers["Last-Event-ID"] = params.pop("last_event_id")
    with http.stream("GET", f"/v1/turns/{turn_id}/events", params=params, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        return [m for m in iter_sse(resp) if m.comment is None and m.data]


def asking_parent(llm_server: Any, tool: str = "delete_file") -> tuple[str, str]:
    """Scripts a t_boss turn whose t_asker child calls `tool`, which asks for approval."""
    child_key = script(
        llm_server, Round(tool_calls=calls((tool, {"path": "/tmp/x"}))), Round(text="child done")
    )
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_asker", {"prompt": f"{child_key} go"}))),
        Round(text="parent done"),
    )
    return key, child_key


def test_a_childs_approval_is_answered_from_the_parents_stream(
    fleet, llm_server, client: Client
) -> None:
    key, _ = asking_parent(llm_server)
    parent = client._start_turn(key, agent="t_boss")
    asked = wait_event(client, parent.turn_id, "interaction_requested")
    child = asked.turn_id
    assert asked.path == [child] and child != parent.turn_id
    # The child's request as the child made it: the same finite timeout.
    assert asked.fields["kind"] == "approval" and asked.fields["timeout_ms"] == 120_000
    client.answer(child, asked.fields["request_id"], parent.token, "approve")
    events = collect(client, parent.turn_id)
    assert events[-1].type == "turn_finished" and not events[-1].path
    relayed = [(e.type, e.fields.get("status")) for e in events if e.path == [child]]
    assert ("interaction_answered", None) in relayed
    assert ("tool_finished", "ok") in relayed
    assert relayed[-1] == ("turn_finished", None)


def test_a_childs_unanswered_approval_is_denied_on_its_timeout(
    fleet, llm_server, client: Client
) -> None:
    key, _ = asking_parent(llm_server, tool="ask_quick")  # a 1 s approval timeout
    parent = client._start_turn(key, agent="t_boss")
    events = collect(client, parent.turn_id)
    assert events[-1].type == "turn_finished", events[-1]
    from_child = [e for e in events if e.path]
    types = [e.type for e in from_child]
    assert types.index("interaction_requested") < types.index("interaction_timed_out")
    (done,) = [e for e in from_child if e.type == "tool_finished"]
    assert done.fields["status"] == "denied"


def test_sse_relays_one_level_by_default_and_resumes_every_stream(
    keyed: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script_asking_echoer(
        llm_server, Round(tool_calls=calls(("echo", {"text": "hi"}))), Round(text="42")
    )
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        r = http.post("/v1/turns", json={"prompt": key, "agent": "t_boss"}, headers=auth(ALICE_KEY))
        assert r.status_code == 202, r.text
        turn_id = r.json()["turn_id"]
        client.wait(turn_id, timeout_s=60)
        full = sse(http, turn_id, ALICE_KEY)
        assert full[-1].event == "turn_finished" and "path" not in full[-1].json()
        child = next(m.json()["child_turn_id"] for m in full if m.event == "subturn_started")
        relayed = [m for m in full if m.json().get("path")]
        assert relayed and all(m.json()["path"] == [child] for m in relayed)
        assert all(m.json()["turn_id"] == child for m in relayed)
        # While a child stream is open, the SSE id names its position too; its end
        # closes it.
        assert all(f",{child}=" in (m.id or "") for m in relayed[:-1])
        assert relayed[-1].event == "turn_finished" and child not in (relayed[-1].id or "")
        assert "," not in (full[-1].id or "")
        assert [m.event for m in relayed] == [e.type for e in collect(client, child, depth=0)]
        # Resuming after any event, relayed or not, loses nothing and repeats nothing.
        for i in (full.index(relayed[0]), full.index(relayed[len(relayed) // 2]), 2):
            rest = sse(http, turn_id, ALICE_KEY, last_event_id=full[i].id)
            assert [m.data for m in rest] == [m.data for m in full[i + 1 :]], i
        none = sse(http, turn_id, ALICE_KEY, depth=0)
        assert not [m for m in none if m.json().get("path")]
        assert [m.data for m in none] == [m.data for m in full if not m.json().get("path")]
        bad = http.get(f"/v1/turns/{turn_id}/events?depth=99", headers=auth(ALICE_KEY))
        assert bad.status_code == 422


def test_nobody_else_reads_or_answers_a_childs_events(
    keyed: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key, _ = asking_parent(llm_server)
    other_key = script(
        llm_server,
        Round(
            tool_calls=calls(
                ("ask_echoer", {"prompt": f"{script(llm_server, Round(text='x'))} go"})
            )
        ),
        Round(text="done"),
    )
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        r = http.post("/v1/turns", json={"prompt": key, "agent": "t_boss"}, headers=auth(ALICE_KEY))
        assert r.status_code == 202, r.text
        parent = r.json()["turn_id"]
        bob = http.post(
            "/v1/turns", json={"prompt": other_key, "agent": "t_boss"}, headers=auth(BOB_KEY)
        )
        assert bob.status_code == 202, bob.text
        bob_turn = bob.json()["turn_id"]
        asked: dict[str, Any] = {}
        with http.stream("GET", f"/v1/turns/{parent}/events", headers=auth(ALICE_KEY)) as resp:
            for msg in iter_sse(resp):
                if msg.event == "interaction_requested":
                    asked = msg.json()
                    break
        child, rid = asked["turn_id"], asked["request_id"]
        assert asked["path"] == [child]
        url = f"/v1/turns/{child}/interactions/{rid}"
        # Another key sees neither the parent's stream nor the child, and cannot answer.
        assert http.get(f"/v1/turns/{parent}/events", headers=auth(BOB_KEY)).status_code == 404
        assert http.get(f"/v1/turns/{child}/events", headers=auth(BOB_KEY)).status_code == 404
        denied = http.post(url, json={"decision": "approve"}, headers=auth(BOB_KEY))
        assert denied.status_code == 404
        # Bob's own stream, resumed with a cursor naming alice's child, stays bob's.
        client.wait(bob_turn, timeout_s=60)
        forged = sse(http, bob_turn, BOB_KEY, last_event_id=f"0-0,{child}=0-0")
        assert forged and {m.json()["turn_id"] for m in forged if m.json().get("path")} <= {
            m.json()["child_turn_id"] for m in forged if m.event == "subturn_started"
        }
        assert child not in {m.json()["turn_id"] for m in forged}
        # The parent's owner answers the child's request.
        ok = http.post(url, json={"decision": "approve"}, headers=auth(ALICE_KEY))
        assert ok.status_code == 200, ok.text
        end = client.wait(parent, timeout_s=60)
        assert end.type == "turn_finished"


def test_relayed_events_keep_type_and_carry_the_emitters_path(
    fleet, llm_server, client: Client
) -> None:
    """The cursor of each event resumes the Python API's follow exactly after it."""
    key = script_asking_echoer(llm_server, Round(text="child"))
    parent = client._start_turn(key, agent="t_boss")
    events: list[Event] = collect(client, parent.turn_id)
    child = next(e.turn_id for e in events if e.path)
    assert {tuple(e.path) for e in events if e.path} == {(child,)}
    assert [e.type for e in events if e.path] == [e.type for e in collect(client, child, depth=0)]
    mid = next(i for i, e in enumerate(events) if e.path and e.type == "llm_started")
    rest = []
    for ev in client.events(parent.turn_id, after_id=events[mid].cursor or ""):
        if ev is not None:
            rest.append(ev)
    # Each stream resumes right after its position; how two streams interleave within a
    # millisecond may differ between the live read and the replay.
    for turn_id in (parent.turn_id, child):
        assert [(e.type, e.seq) for e in rest if e.turn_id == turn_id] == [
            (e.type, e.seq) for e in events[mid + 1 :] if e.turn_id == turn_id
        ]
    assert len(rest) == len(events) - mid - 1 and rest[-1].type == "turn_finished"
    assert not rest[-1].path


def test_the_console_lists_and_answers_a_childs_request_for_the_parents_owner(
    keyed: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key, _ = asking_parent(llm_server)
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        r = http.post("/v1/turns", json={"prompt": key, "agent": "t_boss"}, headers=auth(ALICE_KEY))
        assert r.status_code == 202, r.text
        parent = r.json()["turn_id"]
        asked = wait_event(client, parent, "interaction_requested")
        child = asked.turn_id

        def inbox(key: str) -> list[dict[str, Any]]:
            got = http.get("/v1/interactions", headers=auth(key))
            assert got.status_code == 200, got.text
            return [p for p in got.json()["interactions"] if p["turn_id"] == child]

        (item,) = inbox(ALICE_KEY)
        assert item["parent_turn_id"] == parent and item["agent"] == "t_asker"
        assert inbox(BOB_KEY) == []
        url = f"/v1/console/turns/{child}/interactions/{item['request_id']}"
        assert http.post(url, json={"decision": "deny"}, headers=auth(BOB_KEY)).status_code == 404
        ok = http.post(url, json={"decision": "deny"}, headers=auth(ALICE_KEY))
        assert ok.status_code == 200, ok.text
    events = collect(client, parent)
    (done,) = [e for e in events if e.path and e.type == "tool_finished"]
    assert done.fields["status"] == "denied"
    assert events[-1].type == "turn_finished" and not events[-1].path


def test_sse_resumes_a_live_relay_after_a_disconnect_without_loss_or_repeats(
    keyed: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key, _ = asking_parent(llm_server)
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        r = http.post("/v1/turns", json={"prompt": key, "agent": "t_boss"}, headers=auth(ALICE_KEY))
        assert r.status_code == 202, r.text
        parent = r.json()["turn_id"]
        seen: list[SSEMessage] = []
        with http.stream("GET", f"/v1/turns/{parent}/events", headers=auth(ALICE_KEY)) as resp:
            for msg in iter_sse(resp):
                if msg.comment is None and msg.data:
                    seen.append(msg)
                    if msg.event == "interaction_requested":
                        break
        asked = seen[-1].json()
        child = asked["turn_id"]
        assert f",{child}=" in (seen[-1].id or "")  # the child's stream is open
        url = f"/v1/turns/{child}/interactions/{asked['request_id']}"
        assert http.post(url, json={"decision": "approve"}, headers=auth(ALICE_KEY)).is_success
        assert client.wait(parent, timeout_s=60).type == "turn_finished"
        rest = sse(http, parent, ALICE_KEY, last_event_id=seen[-1].id)
        full = sse(http, parent, ALICE_KEY)
    # The relayed answer is the child's first event after the resume point (the parent's
    # own heartbeat `tool_progress` of the call may come before it, if the answer took a
    # progress interval on a loaded machine); together, every event once.
    relayed = [m for m in rest if m.json().get("path")]
    assert relayed[0].event == "interaction_answered" and relayed[0].json()["path"] == [child]
    assert all(m.event == "tool_progress" for m in rest[: rest.index(relayed[0])])
    assert len(seen) + len(rest) == len(full)
    assert sorted(m.data for m in seen + rest) == sorted(m.data for m in full)
