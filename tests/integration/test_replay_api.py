"""Retry and fork over HTTP with keys: who may (the owner, an admin; anyone else 404), what
is refused (409 with the status, 410, 422 naming the field), a fork of a conversation's turn
as a new conversation, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.config import load_settings
from agentq.gateway import create_app
from agentq.local.processes import run_process, wait_for
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from tests.helpers import assert_valid_history, calls, collect, follow_until, script

pytestmark = pytest.mark.integration

ALICE, BOB, OPS = "alice-secret-0123456789", "bob-secret-0123456789", "ops-secret-0123456789"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gw(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    settings = load_settings(
        api_keys=f"alice={ALICE},bob={BOB}",
        admin_keys=f"ops={OPS}",
        start_burst=10_000,
        start_rate_per_s=1000.0,
    )
    with BackgroundServer(create_app(Client(settings))) as server:
        yield server


def _start(gw: BackgroundServer, key: str, **body: Any) -> str:
    r = httpx.post(f"{gw.url}/v1/turns", json=body, headers=auth(key))
    assert r.status_code == 202, r.text
    return str(r.json()["turn_id"])


def _post(gw: BackgroundServer, turn_id: str, what: str, key: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/turns/{turn_id}/{what}", json=body, headers=auth(key))


def test_who_may_retry_and_what_is_refused(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script(llm_server, Round(text="second time lucky", fault="http_400", fault_times=1))
    source = _start(gw, ALICE, prompt=key)
    assert collect(client, source)[-1].type == "turn_error"
    assert _post(gw, source, "retry", BOB).status_code == 404
    assert _post(gw, source, "fork", BOB, at_round=1).status_code == 404
    r = _post(gw, source, "retry", ALICE)
    assert r.status_code == 202, r.text
    retry = r.json()["turn_id"]
    assert r.json()["events_url"] == f"/v1/turns/{retry}/events"
    assert collect(client, retry)[-1].fields["content"] == "second time lucky"
    assert client.get(retry)["state"]["owner"] == "alice"
    view = httpx.get(f"{gw.url}/v1/turns/{retry}/timeline", headers=auth(ALICE)).json()
    assert view["source"] == {"kind": "retry", "turn_id": source, "from_round": 1}
    # An admin may retry anyone's turn; the retry stays its source's owner's.
    again = _post(gw, source, "retry", OPS)
    assert again.status_code == 202
    assert client.get(again.json()["turn_id"])["state"]["owner"] == "alice"
    finished = _post(gw, retry, "retry", ALICE)
    assert finished.status_code == 409
    assert finished.json()["error"]["code"] == "not_retryable"
    assert finished.json()["error"]["status"] == "finished"
    unknown = _post(gw, source, "retry", ALICE, rerun_lost=True, bogus=1)
    assert unknown.status_code == 422 and "bogus" in unknown.json()["error"]["message"]


def test_a_running_turn_is_not_retried(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))))
    source = _start(gw, ALICE, prompt=key)
    follow_until(client, source, "tool_started")
    r = _post(gw, source, "retry", ALICE)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["status"] == "running"
    assert "still runs" in r.json()["error"]["message"]
    client.abort(source, None, operator=True)
    follow_until(client, source, "turn_aborted")


def test_fork_refuses_rounds_out_of_range_and_bad_edits(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script(
        llm_server, Round(tool_calls=calls(("echo", {"text": "one"}))), Round(text="Two rounds.")
    )
    source = _start(gw, ALICE, prompt=key)
    assert collect(client, source)[-1].type == "turn_finished"
    cases = [
        ({"at_round": 0}, "at_round"),
        ({"at_round": 3}, "at_round"),
        ({"at_round": 1, "edit": {"colour": "red"}}, "edit.colour"),
        ({"at_round": 1, "edit": {"message": ""}}, "edit.message"),
        ({"at_round": 1, "edit": {"tool_result": {"call_id": "c1", "content": "x"}}}, "edit"),
    ]
    for body, field in cases:
        r = _post(gw, source, "fork", ALICE, **body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["message"].startswith(field), (body, r.json())
    assert "1..2" in _post(gw, source, "fork", ALICE, at_round=3).json()["error"]["message"]
    r = _post(gw, source, "fork", ALICE, at_round=2)
    assert r.status_code == 202, r.text
    events = collect(client, r.json()["turn_id"])
    assert events[-1].fields["content"] == "Two rounds."
    assert not [e for e in events if e.type == "tool_started"]  # round 1 reused


def test_fork_of_a_conversation_turn_is_a_new_conversation(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script(
        llm_server, Round(tool_calls=calls(("echo", {"text": "first"}))), Round(text="Done.")
    )
    conv = f"c-{uuid.uuid4().hex[:8]}"
    source = _start(gw, ALICE, prompt=key, conversation_id=conv)
    assert collect(client, source)[-1].type == "turn_finished"
    wait_for(lambda: client.conversation(conv, operator=True)["status"] == "idle", 10)
    original = client.conversation(conv, operator=True)["messages"]
    r = _post(gw, source, "fork", ALICE, at_round=2)
    assert r.status_code == 202, r.text
    branch = r.json()["conversation_id"]
    assert branch != conv and branch.startswith(conv)
    collect(client, r.json()["turn_id"])
    wait_for(lambda: client.conversation(branch, operator=True)["status"] == "idle", 10)
    assert client.conversation(conv, operator=True)["messages"] == original
    branched = client.conversation(branch, operator=True)["messages"]
    assert branched[:3] == original[:3] and branched[-1]["content"] == "Done."
    assert_valid_history(branched)
    # The branch is alice's: she continues it with her key.
    more = _start(gw, ALICE, prompt="and then?", conversation_id=branch)
    collect(client, more)
    # A source whose conversation was deleted is gone for retry and fork: 410.
    assert httpx.delete(f"{gw.url}/v1/conversations/{conv}", headers=auth(ALICE)).status_code == 200
    gone = _post(gw, source, "fork", ALICE, at_round=1)
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "source_gone"


def test_cli_retry_and_fork(
    fleet: Any, llm_server: Any, client: Client, agentq_env: dict[str, str]
) -> None:
    key = script(llm_server, Round(text="cli retried", fault="http_400", fault_times=1))
    source = client._start_turn(key).turn_id
    assert collect(client, source)[-1].type == "turn_error"

    def agentq(*args: str) -> subprocess.CompletedProcess[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
        return run_process([sys.executable, "-m", "agentq", *args], env={**base, **agentq_env})

    out = agentq("retry", source[:12], "--json")
    assert out.returncode == 0, out.stderr
    retry = json.loads(out.stdout)["turn_id"]
    assert collect(client, retry)[-1].fields["content"] == "cli retried"
    out = agentq("show", retry)
    assert out.returncode == 0, out.stderr
    assert f"retry of {source}, from round 1" in out.stdout
    shown = json.loads(agentq("show", retry, "--json").stdout)
    assert shown["source"] == {"kind": "retry", "turn_id": source, "from_round": 1}
    out = agentq("retry", retry)
    assert out.returncode == 1 and "finished" in out.stderr
    out = agentq("fork", source, "--at-round", "7")
    assert out.returncode == 2 and "at_round: must be 1..1" in out.stderr
    out = agentq("fork", source, "--at-round", "1", "--instructions", "Be brief.")
    assert out.returncode == 0, out.stderr
    assert f"(fork at round 1 of {source})" in out.stdout


def test_bulk_retry_retries_each_matching_turn_once(
    gw: BackgroundServer, llm_server: Any, client: Client, agentq_env: dict[str, str]
) -> None:
    failing = [
        script(llm_server, Round(text=f"bulk {n}", fault="http_400", fault_times=1))
        for n in range(2)
    ]
    sources = [_start(gw, BOB, prompt=key, agent="t_echoer") for key in failing]
    fine = _start(gw, BOB, prompt=script(llm_server, Round(text="fine")), agent="t_echoer")
    for tid in [*sources, fine]:
        collect(client, tid)
    body = {"agent": "t_echoer", "since_s": 120}

    def bulk(key: str, **extra: Any) -> list[dict[str, Any]]:
        r = httpx.post(f"{gw.url}/v1/turns/retry", json=body | extra, headers=auth(key))
        assert r.status_code == 200, r.text
        return list(r.json()["turns"])

    assert bulk(ALICE) == []  # not her turns
    dry = bulk(BOB, dry_run=True)
    assert dry == [{"source": s, "outcome": "would_start"} for s in reversed(sources)]
    started = bulk(BOB)
    assert [t["outcome"] for t in started] == ["started", "started"]
    retries = {t["source"]: t["turn_id"] for t in started}
    for source in sources:
        assert client.get(retries[source])["state"]["retry_of"] == source
        assert collect(client, retries[source])[-1].type == "turn_finished"
    again = bulk(BOB)
    assert {t["source"]: (t["outcome"], t["turn_id"]) for t in again} == {
        s: ("retried_already", retries[s]) for s in sources
    }
    # From Python: the same records, so nothing is retried twice.
    heard: list[str] = []
    from_python = client.retry_many(
        agent="t_echoer", since_s=120, said=lambda o: heard.append(o.source)
    )
    # (A Redis credential sees every owner's turns: others of this module's may match too.)
    by_source = {o.source: (o.outcome, o.turn_id) for o in from_python}
    assert {s: by_source.get(s) for s in sources} == {
        s: ("retried_already", retries[s]) for s in sources
    }
    assert set(sources) <= set(heard) and len(heard) == len(from_python)
    bad = httpx.post(f"{gw.url}/v1/turns/retry", json={"status": "finished"}, headers=auth(BOB))
    assert bad.status_code == 422 and bad.json()["error"]["message"].startswith("status")
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
    out = run_process(
        [
            sys.executable,
            "-m",
            "agentq",
            "retry",
            "--status",
            "error",
            "--agent",
            "t_echoer",
            "--since",
            "2m",
            "--dry-run",
            "--json",
        ],
        env={**base, **agentq_env},
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert {d["source"]: d["outcome"] for d in lines if d["source"] in sources} == {
        s: "retried_already" for s in sources
    }


def test_console_bulk_retry_is_the_bulk_retry_for_the_callers_turns(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    failing = [
        script(llm_server, Round(text=f"console bulk {n}", fault="http_400", fault_times=1))
        for n in range(2)
    ]
    sources = [_start(gw, BOB, prompt=key, agent="t_waiter") for key in failing]
    for tid in sources:
        assert collect(client, tid)[-1].type == "turn_error"
    body = {"status": "error,aborted", "agent": "t_waiter", "since_s": 120}

    def console(key: str | None, **extra: Any) -> httpx.Response:
        headers = auth(key) if key else {}
        return httpx.post(f"{gw.url}/v1/console/turns/retry", json=body | extra, headers=headers)

    def turns(key: str, **extra: Any) -> list[dict[str, Any]]:
        r = console(key, **extra)
        assert r.status_code == 200, r.text
        return list(r.json()["turns"])

    assert console(None).status_code == 401
    assert turns(ALICE, dry_run=True) == [] and turns(ALICE) == []  # not her turns
    dry = turns(BOB, dry_run=True)
    assert dry == [{"source": s, "outcome": "would_start"} for s in reversed(sources)]
    assert turns(OPS, dry_run=True) == dry  # an admin's: every owner's
    started = turns(BOB)
    assert [t["outcome"] for t in started] == ["started", "started"]
    retries = {t["source"]: t["turn_id"] for t in started}
    for source in sources:
        assert client.get(retries[source])["state"]["retry_of"] == source
        assert collect(client, retries[source])[-1].fields["content"].startswith("console bulk")
    again = turns(BOB)
    assert {t["source"]: (t["outcome"], t["turn_id"]) for t in again} == {
        s: ("retried_already", retries[s]) for s in sources
    }
    bad = console(BOB, since_s=-1)
    assert bad.status_code == 422 and bad.json()["error"]["message"].startswith("since_s")


def test_retry_of_a_conversations_last_turn_cut_short_goes_on_in_it(
    gw: BackgroundServer, llm_server: Any, client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("echo", {"text": "kept"}), ("hang", {"seconds": 60}))),
        Round(text="In place."),
    )
    conv = f"c-{uuid.uuid4().hex[:8]}"
    source = _start(gw, ALICE, prompt=key, conversation_id=conv)
    seen: set[str] = set()

    def mid_round(ev: Any) -> bool:
        if ev.type in ("tool_started", "tool_finished"):
            seen.add(f"{ev.type}:{ev.fields['tool']}")
        return {"tool_started:hang", "tool_finished:echo"} <= seen

    collect(client, source, until=mid_round)
    assert _post(gw, source, "abort", ALICE).status_code == 200
    follow_until(client, source, "turn_aborted")
    wait_for(lambda: client.conversation(conv, operator=True)["status"] == "idle", 10)
    r = _post(gw, source, "retry", ALICE)
    assert r.status_code == 202, r.text
    assert r.json()["conversation_id"] == conv and r.json()["branched"] is False
    events = collect(client, r.json()["turn_id"])
    assert events[-1].fields["content"] == "In place."
    assert not [e for e in events if e.type == "tool_started"]
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["lost"]
    wait_for(lambda: client.conversation(conv, operator=True)["status"] == "idle", 10)
    messages = client.conversation(conv, operator=True)["messages"]
    # The source's exchange (its cancelled call's result) replaced: one result per call.
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[2]["content"] == "kept" and "lost" in messages[3]["content"]
    assert_valid_history(messages)
    # A second retry of the same source: the conversation moved on (the first retry is its
    # last turn now), so it branches.
    again = _post(gw, source, "retry", ALICE)
    assert again.status_code == 202, again.text
    assert again.json()["branched"] is True and again.json()["conversation_id"] != conv
    collect(client, again.json()["turn_id"])
    wait_for(lambda: client.conversation(conv, operator=True)["status"] == "idle", 10)
    assert client.conversation(conv, operator=True)["messages"] == messages
