"""Many clients, one conversation: 50 messages from 10 threads through two gateways (each
its own `agentq serve` process) under each multitask policy, with a turn worker SIGKILLed
half-way. Every accepted message ends up in the history exactly once (or, rolled back,
not at all), no two turns of the conversation ever run at once, every tool call is
answered."""

from __future__ import annotations

import itertools
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agentq import constants as k
from agentq.events import TERMINAL_TYPES
from agentq.local.processes import ManagedProcess, start_process, wait_for
from agentq.local.redis_server import find_free_port
from agentq.testing.openai_server import Round
from tests.faults.rig import LOGS, Rig
from tests.helpers import assert_valid_history, calls

pytestmark = [pytest.mark.integration, pytest.mark.faults]

THREADS = 10
PER_THREAD = 5
KEY = "k-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": f"Bearer b-{uuid.uuid4().hex}"}


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig("conversations")
    try:
        r.start("tools", "llm", "turns", "turns")
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def gateways(rig: Rig) -> Iterator[list[str]]:
    procs: list[ManagedProcess] = []
    urls = []
    try:
        for i in range(2):
            port = find_free_port()
            # A log left by an earlier run would show its "Uvicorn running" line as this one's.
            (LOGS / f"conversations-gateway-{i}.log").unlink(missing_ok=True)
            procs.append(
                start_process(
                    [sys.executable, "-m", "agentq", "serve", "--port", str(port)],
                    # One user's key: one conversation from many tabs and retries.
                    env={
                        **rig.env,
                        "AGENTQ_API_KEYS": f"alice={KEY},bob={OTHER['Authorization'][7:]}",
                        # 250 starts of one key in a minute: past the default start rate.
                        "AGENTQ_START_RATE_PER_S": "1000",
                        "AGENTQ_START_BURST": "1000",
                    },
                    log_path=LOGS / f"conversations-gateway-{i}.log",
                    ready_pattern="Uvicorn running",
                    name=f"gateway-{i}",
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for p in procs:
            p.stop()


def _send_all(
    urls: list[str], conv: str, mode: str, first: str, halfway: Callable[[], object]
) -> tuple[list[dict[str, Any]], int]:
    """Each thread sends its messages in turn, alternating gateways; returns what was
    accepted (text, the answer) in the order the answers came, and how many were refused.
    `halfway` runs once half of the messages were answered."""
    accepted: list[dict[str, Any]] = []
    refused = [0]
    answered = [0]
    lock = threading.Lock()
    errors: list[str] = []

    def run(thread: int) -> None:
        with httpx.Client(timeout=30, headers=AUTH) as http:
            for n in range(PER_THREAD):
                text = f"{first} t{thread}-m{n}"
                url = urls[(thread + n) % 2]
                body = {"prompt": text, "conversation_id": conv, "multitask": mode}
                r = http.post(f"{url}/v1/turns", json=body)
                with lock:
                    if r.status_code == 202:
                        accepted.append({"text": text, "thread": thread, "n": n, **r.json()})
                    elif r.status_code == 409 and mode == "reject":
                        assert r.json()["error"]["code"] == "conversation_busy"
                        refused[0] += 1
                    else:
                        errors.append(f"{r.status_code} {r.text}")
                    answered[0] += 1
                    if answered[0] == THREADS * PER_THREAD // 2:
                        halfway()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    return accepted, refused[0]


def _idle(url: str, conv: str) -> dict[str, Any] | None:
    got = httpx.get(f"{url}/v1/conversations/{conv}", timeout=10, headers=AUTH).json()
    return got if got["status"] == "idle" and not got["queued"] else None


def _intervals(rig: Rig, turn_ids: set[str]) -> list[tuple[float, float, str]]:
    """(started, ended, turn id) of every turn that ran, from the replay logs."""
    out = []
    for tid in turn_ids:
        events = rig.log_events(tid)
        started = [e.ts for e in events if e.type == "turn_started"]
        ended = [e for e in events if e.type in TERMINAL_TYPES]
        assert ended, f"turn {tid} never ended"
        if started:
            out.append((started[0], ended[-1].ts, tid))
    return sorted(out)


@pytest.mark.parametrize("mode", ["enqueue", "inject", "interrupt", "rollback", "reject"])
def test_fifty_messages_into_one_conversation(rig: Rig, gateways: list[str], mode: str) -> None:
    conv = f"load-{mode}-{uuid.uuid4().hex[:8]}"
    # Every other round calls a tool: a SIGKILL lands among calls and rounds alike.
    first = rig.script(
        *[
            Round(tool_calls=calls(("echo", {"text": f"r{i}"})))
            if i % 2 == 0
            else Round(text=f"answer {i}")
            for i in range(400)
        ]
    )
    victim = rig.worker("turns")
    accepted, refused = _send_all(gateways, conv, mode, first, halfway=victim.kill)
    assert not victim.is_running(), "the turn worker was not killed half-way"
    rig.start("turns")
    assert accepted, "nothing was accepted"
    final = wait_for(lambda: _idle(gateways[0], conv), 180, 0.2, message="the conversation idle")
    assert isinstance(final, dict)
    history = final["messages"]
    assert_valid_history(history)
    texts = [str(m["content"]) for m in history if m["role"] == "user"]
    turn_ids = {a["message_turn_id"] if a.get("injected") else a["turn_id"] for a in accepted}
    ran = _intervals(rig, turn_ids | {a["turn_id"] for a in accepted})
    for (_, end, a), (start, _, b) in itertools.pairwise(ran):
        assert start >= end, f"turns {a} and {b} of one conversation ran at once"
    sent = [a["text"] for a in accepted]
    if mode == "rollback":
        rolled = {
            tid
            for tid in turn_ids
            if any(
                e.type == "turn_aborted" and e.fields.get("reason") == "rollback"
                for e in rig.log_events(tid)
            )
        }
        kept = [a["text"] for a in accepted if a["turn_id"] not in rolled]
        assert sorted(texts) == sorted(kept)
        assert len(set(texts)) == len(texts)
    else:
        # Exactly once each: none lost, none twice.
        assert sorted(texts) == sorted(sent), (len(texts), len(sent))
    if mode == "reject":
        assert refused + len(accepted) == THREADS * PER_THREAD
    if mode in ("enqueue", "reject"):
        # In acceptance order: each thread's messages (sent one after another) keep theirs.
        for t in range(THREADS):
            mine = [x for x in texts if f" t{t}-" in x]
            assert mine == sorted(mine, key=lambda x: int(x.rsplit("-m", 1)[1])), mine
    assert final["running_turn_id"] is None
    # No turn's append found the history changed under it (RELEASE counts any that did).
    meta = rig.client._store.redis.hget(k.conversation_key(conv, "meta"), "conflicts")
    assert meta is None, f"{meta} appends found the history changed under them"


def test_twelve_retries_through_two_gateways_start_one_turn(rig: Rig, gateways: list[str]) -> None:
    body = {"prompt": rig.script(Round(text="once only"))}
    key = f"retry-{uuid.uuid4().hex}"
    barrier = threading.Barrier(12)
    answers: list[httpx.Response] = []

    def post(i: int) -> None:
        with httpx.Client(timeout=30) as http:
            barrier.wait(10)
            r = http.post(
                f"{gateways[i % 2]}/v1/turns", json=body, headers={**AUTH, "Idempotency-Key": key}
            )
            answers.append(r)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in answers] == [202] * 12
    assert len({(r.json()["turn_id"], r.json()["token"]) for r in answers}) == 1
    turn_id = answers[0].json()["turn_id"]
    assert rig.collect(turn_id)[-1].type == "turn_finished"
    # One turn ran: the model was asked for this prompt once.
    asked = [
        r
        for r in list(rig.llm.requests)
        if any(m.get("content") == body["prompt"] for m in r.get("messages", []))
    ]
    assert len(asked) == 1
    # The same key, another body: refused; another caller's same key: its own turn.
    other = httpx.post(
        f"{gateways[0]}/v1/turns",
        json={"prompt": body["prompt"] + "!"},
        headers={**AUTH, "Idempotency-Key": key},
    )
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    bobs = httpx.post(
        f"{gateways[0]}/v1/turns", json=body, headers={**OTHER, "Idempotency-Key": key}
    )
    assert bobs.status_code == 202 and bobs.json()["turn_id"] != turn_id


@pytest.mark.parametrize(
    ("body", "headers", "says"),
    [
        ({"multitask": "queue"}, {}, "enqueue"),
        ({}, {"Idempotency-Key": ""}, "empty"),
        ({}, {"Idempotency-Key": "k" * 256}, "255"),
    ],
)
def test_bad_conversation_input_is_refused_clearly(
    rig: Rig, gateways: list[str], body: dict[str, Any], headers: dict[str, str], says: str
) -> None:
    conv = f"bad-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        f"{gateways[0]}/v1/turns",
        json={"prompt": "hi", "conversation_id": conv, **body},
        headers={**AUTH, **headers},
    )
    assert r.status_code == 422, r.text
    assert says in r.json()["error"]["message"] or says in str(r.json()["error"].get("detail"))
    # Nothing was stored for it.
    assert httpx.get(f"{gateways[0]}/v1/conversations/{conv}", headers=AUTH).status_code == 404


def test_a_conversation_is_its_owners_alone(rig: Rig, gateways: list[str]) -> None:
    conv = f"mine-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        f"{gateways[0]}/v1/turns",
        json={"prompt": rig.script(Round(text="private")), "conversation_id": conv},
        headers=AUTH,
    )
    assert r.status_code == 202
    rig.collect(r.json()["turn_id"])
    mine = httpx.get(f"{gateways[1]}/v1/conversations/{conv}", headers=AUTH)
    assert mine.status_code == 200 and mine.json()["status"] == "idle"
    assert [m["role"] for m in mine.json()["messages"]] == ["user", "assistant"]
    unknown = httpx.get(f"{gateways[1]}/v1/conversations/nope-{conv}", headers=OTHER)
    for verb in ("GET", "DELETE"):
        theirs = httpx.request(verb, f"{gateways[1]}/v1/conversations/{conv}", headers=OTHER)
        # The same answer an unknown conversation gets: no hint that it exists.
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"]["type"] == unknown.json()["error"]["type"]
    sent = httpx.post(
        f"{gateways[0]}/v1/turns", json={"prompt": "hi", "conversation_id": conv}, headers=OTHER
    )
    assert sent.status_code == 404
    assert httpx.get(f"{gateways[0]}/v1/conversations/{conv}").status_code == 401
    listed = httpx.get(f"{gateways[0]}/v1/conversations", headers=OTHER).json()
    assert conv not in [c["conversation_id"] for c in listed["conversations"]]
    listed = httpx.get(f"{gateways[0]}/v1/conversations?limit=5", headers=AUTH).json()
    assert conv in [c["conversation_id"] for c in listed["conversations"]]
    gone = httpx.delete(f"{gateways[0]}/v1/conversations/{conv}", headers=AUTH)
    assert gone.status_code == 200 and gone.json()["aborted_turns"] == []
    assert httpx.get(f"{gateways[1]}/v1/conversations/{conv}", headers=AUTH).status_code == 404
