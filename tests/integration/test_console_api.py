"""The operator console's list API over a real Redis: filters, paging, ownership, retention."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.models import InteractionRequest, InvocationRecord, ToolResult, TurnStatus
from agentq.state.listing import TurnLister, TurnQuery
from agentq.state.store import TurnStore
from agentq.testing.gateway import BackgroundServer

pytestmark = pytest.mark.integration

ALICE_KEY = "alice-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"


@pytest.fixture(scope="module")
def store(agentq_env: dict[str, str]) -> TurnStore:
    return Client()._store


@pytest.fixture(scope="module")
def open_gateway(agentq_env: dict[str, str]) -> Iterator[httpx.Client]:
    app = create_app(Client())
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield http


@pytest.fixture(scope="module")
def keyed_gateway(agentq_env: dict[str, str]) -> Iterator[httpx.Client]:
    settings = load_settings(api_keys=f"alice={ALICE_KEY}", admin_keys=f"ops={ADMIN_KEY}")
    app = create_app(Client(settings))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield http


def make_turn(
    store: TurnStore,
    *,
    agent: str,
    created_at: float,
    status: str = "queued",
    owner: str | None = None,
) -> str:
    turn_id = uuid.uuid4().hex
    state: dict[str, Any] = {
        "status": "queued",
        "created_at": created_at,
        "agent": agent,
        "owner": owner,
        "round": 0,
        "call_count": 0,
    }
    store.create(turn_id, state, [{"role": "user", "content": "hi"}])
    if status != "queued":
        store.update(turn_id, status="running", started_at=created_at + 1)
    if status in ("finished", "aborted", "error"):
        store.close(turn_id, TurnStatus(status), "turn_finished", {})
    return turn_id


def result(call_id: str, tool: str, status: str) -> ToolResult:
    rec = InvocationRecord(call_id=call_id, tool=tool, status=status)  # type: ignore[arg-type]
    return ToolResult(call_id=call_id, tool=tool, status=status, content="x", record=rec)  # type: ignore[arg-type]


def ids(body: dict[str, Any]) -> list[str]:
    return [t["turn_id"] for t in body["turns"]]


def test_filters_and_paging_newest_first(store: TurnStore, open_gateway: httpx.Client) -> None:
    agent = f"a-{uuid.uuid4().hex[:8]}"
    other = f"b-{uuid.uuid4().hex[:8]}"
    t0 = time.time() - 100
    statuses = ["queued", "running", "finished", "aborted", "running", "finished", "queued"]
    made = [
        make_turn(store, agent=agent, created_at=t0 + i, status=s) for i, s in enumerate(statuses)
    ]
    theirs = make_turn(store, agent=other, created_at=t0 + 3.5, status="running")
    newest_first = list(reversed(made))

    seen: list[str] = []
    before: Any = None
    pages = 0
    while True:
        params = {"agent": agent, "limit": "3", **({"before": before} if before else {})}
        r = open_gateway.get("/v1/turns", params=params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["turns"]) <= 3
        seen += ids(body)
        pages += 1
        before = body["next_before"]
        if before is None:
            break
    assert seen == newest_first and pages == 3
    assert theirs not in seen

    r = open_gateway.get("/v1/turns", params={"agent": agent, "status": "finished"})
    assert ids(r.json()) == [made[5], made[2]]
    r = open_gateway.get("/v1/turns", params={"agent": agent, "status": "active"})
    assert ids(r.json()) == [made[6], made[4], made[1], made[0]]
    r = open_gateway.get("/v1/turns", params={"agent": agent, "status": "aborted,queued"})
    assert ids(r.json()) == [made[6], made[3], made[0]]

    row = next(t for t in r.json()["turns"] if t["turn_id"] == made[3])
    assert row["status"] == "aborted" and row["agent"] == agent
    assert row["started_at"] == pytest.approx(t0 + 4) and row["ended_at"] is not None
    assert row["duration_s"] == pytest.approx(row["ended_at"] - row["started_at"], abs=0.01)

    for bad in ({"limit": "0"}, {"limit": "x"}, {"status": "sleeping"}, {"before": "nan"}):
        r = open_gateway.get("/v1/turns", params=bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["type"] == "ValidationError"


def test_call_counts_and_pending_interactions(store: TurnStore, open_gateway: httpx.Client) -> None:
    agent = f"c-{uuid.uuid4().hex[:8]}"
    turn_id = make_turn(store, agent=agent, created_at=time.time(), status="running")
    store.record_dispatch(
        turn_id,
        {
            c: {"tool": t, "task_id": f"{turn_id}.{c}.1", "dispatched_at": time.time()}
            for c, t in [("c1", "echo"), ("c2", "stuck"), ("c3", "hang"), ("c4", "echo")]
        },
    )
    store.redis.hset(k.turn_key(turn_id), k.STARTED + "c3", '{"worker": "w1", "pid": 7}')
    assert store.settle(turn_id, result("c1", "echo", "ok"), wake=False)
    assert store.settle(turn_id, result("c2", "stuck", "timeout"), wake=False)
    store.redis.hset(k.turn_key(turn_id), k.PLANNED + "c5", "{}")
    req = InteractionRequest(
        request_id="c5.approval",
        kind="approval",
        tool="delete_file",
        prompt="ok?",
        timeout_ms=90_000,
    )
    store.open_interaction(turn_id, req)

    row = open_gateway.get("/v1/turns", params={"agent": agent}).json()["turns"][0]
    assert row["calls"] == {"ok": 1, "queued": 1, "running": 1, "timeout": 1}
    assert {(c["call_id"], c["state"]) for c in row["current_tools"]} == {
        ("c3", "running"),
        ("c4", "queued"),
    }
    [pending] = row["pending_interactions"]
    assert pending["request_id"] == "c5.approval" and pending["tool"] == "delete_file"
    assert pending["expires_at"] == pytest.approx(req.created_at + 90)

    inbox = open_gateway.get("/v1/interactions").json()["interactions"]
    assert [p["request_id"] for p in inbox if p["turn_id"] == turn_id] == ["c5.approval"]
    r = open_gateway.post(
        f"/v1/console/turns/{turn_id}/interactions/c5.approval", json={"decision": "deny"}
    )
    assert r.status_code == 200, r.text
    row = open_gateway.get("/v1/turns", params={"agent": agent}).json()["turns"][0]
    assert row["pending_interactions"] == []
    r = open_gateway.post(
        f"/v1/console/turns/{turn_id}/interactions/c5.approval", json={"decision": "deny"}
    )
    assert r.status_code == 409


def test_keys_list_their_own_turns_and_admins_all(
    store: TurnStore, keyed_gateway: httpx.Client
) -> None:
    agent = f"k-{uuid.uuid4().hex[:8]}"
    now = time.time()
    mine = make_turn(store, agent=agent, created_at=now, owner="alice", status="running")
    other = make_turn(store, agent=agent, created_at=now + 1, owner="bob", status="running")
    params = {"agent": agent}
    assert keyed_gateway.get("/v1/turns", params=params).status_code == 401
    bad = {"Authorization": "Bearer not-a-key-at-all-000000"}
    assert keyed_gateway.get("/v1/turns", params=params, headers=bad).status_code == 401
    alice = {"Authorization": f"Bearer {ALICE_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert ids(keyed_gateway.get("/v1/turns", params=params, headers=alice).json()) == [mine]
    assert ids(keyed_gateway.get("/v1/turns", params=params, headers=admin).json()) == [
        other,
        mine,
    ]
    assert keyed_gateway.get(f"/v1/turns/{other}/timeline", headers=alice).status_code == 404
    assert keyed_gateway.get(f"/v1/turns/{other}/timeline", headers=admin).status_code == 200
    r = keyed_gateway.post(f"/v1/console/turns/{other}/abort", headers=alice)
    assert r.status_code == 404
    assert store.status(other) == "running"


def test_finished_turns_expire_with_all_their_keys_and_leave_the_index(
    agentq_env: dict[str, str], store: TurnStore
) -> None:
    short = TurnStore(store.redis, ttl_s=1)
    lister = TurnLister(store.redis)
    agent = f"r-{uuid.uuid4().hex[:8]}"
    kept = make_turn(store, agent=agent, created_at=time.time() - 5, status="running")
    gone = make_turn(short, agent=agent, created_at=time.time(), status="running")
    short.record_dispatch(gone, {"c1": {"tool": "echo", "dispatched_at": time.time()}})
    short.redis.hset(k.turn_key(gone), k.STARTED + "c1", '{"worker": "w1"}')
    short.settle(gone, result("c1", "echo", "ok"), wake=False)
    short.redis.hset(k.turn_key(gone), k.PLANNED + "c1", "{}")
    short.bus.publish(gone, "llm_started")
    assert short.close(gone, TurnStatus.FINISHED, "turn_finished", {})

    query = TurnQuery(agent=agent)
    assert [t["turn_id"] for t in lister.page(query).turns] == [gone, kept]
    assert 0 < store.redis.ttl(k.turn_key(gone)) <= 1

    def leftovers() -> list[bytes]:
        return list(store.redis.scan_iter(match=f"{k.turn_key(gone)}*"))

    wait_for(lambda: not leftovers(), timeout_s=10, message="the turn's keys did not expire")
    assert store.redis.zscore(k.TURNS_INDEX, gone) is not None  # until a listing meets it
    assert [t["turn_id"] for t in lister.page(query).turns] == [kept]
    assert store.redis.zscore(k.TURNS_INDEX, gone) is None
    assert store.redis.zscore(k.TURNS_INDEX, kept) is not None


def test_retention_setting_and_its_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTQ_TURN_RETENTION_S", raising=False)
    monkeypatch.delenv("AGENTQ_STATE_TTL_S", raising=False)
    assert load_settings().turn_retention_s == 7 * 24 * 3600
    monkeypatch.setenv("AGENTQ_STATE_TTL_S", "60")
    assert load_settings().turn_retention_s == 60
    monkeypatch.setenv("AGENTQ_TURN_RETENTION_S", "120")
    assert load_settings().turn_retention_s == 120
    monkeypatch.setenv("AGENTQ_TURN_RETENTION_S", "soon")
    with pytest.raises(Exception, match="AGENTQ_TURN_RETENTION_S"):
        load_settings()


def test_a_turn_waiting_for_model_capacity_says_so(
    store: TurnStore, open_gateway: httpx.Client
) -> None:
    agent = f"w-{uuid.uuid4().hex[:8]}"
    since = time.time() - 3
    turn_id = make_turn(store, agent=agent, created_at=since - 1, status="running")
    # As admission leaves it: the round's wait on the state, `llm_queued` in the log.
    store.update(turn_id, llm_wait_round=0, llm_wait_since=since, llm_wait_position=2)
    store.bus.publish(
        turn_id, "llm_queued", round_no=0, model="m", position=2, wait_s=1.5, first=True
    )
    row = open_gateway.get("/v1/turns", params={"agent": agent}).json()["turns"][0]
    assert row["model_wait"] == {"round": 0, "since": since, "position": 2}
    view = open_gateway.get(f"/v1/turns/{turn_id}/timeline").json()
    assert view["turn"]["model_wait"]["position"] == 2
    [queued] = [e for e in view["events"] if e["type"] == "llm_queued"]
    assert queued["fields"]["model"] == "m" and queued["fields"]["first"] is True

    # Granted: the round goes out, and says how long it waited.
    store.update(turn_id, llm_wait_round=None, llm_wait_since=None, llm_wait_position=None)
    store.bus.publish(turn_id, "llm_started", round_no=0, model="m", queued_ms=3000)
    view = open_gateway.get(f"/v1/turns/{turn_id}/timeline").json()
    assert view["turn"]["model_wait"] is None
    [rnd] = view["rounds"]
    assert rnd["queued_ms"] == 3000 and rnd["model"] == "m" and rnd["status"] == "running"

    # A turn that ended while waiting does not wait any more.
    store.update(turn_id, llm_wait_round=1, llm_wait_since=time.time())
    store.close(turn_id, TurnStatus.ABORTED, "turn_aborted", {"reason": "user"})
    row = open_gateway.get("/v1/turns", params={"agent": agent}).json()["turns"][0]
    assert row["status"] == "aborted" and row["model_wait"] is None


def test_bulk_retry_without_keys_is_for_this_machine_only(agentq_env: dict[str, str]) -> None:
    app = create_app(Client())
    body = {"agent": f"none-{uuid.uuid4().hex[:8]}", "dry_run": True}
    remote = TestClient(app, base_url="http://127.0.0.1", client=("10.0.0.5", 50000))
    r = remote.post("/v1/console/turns/retry", json=body)
    assert r.status_code == 403 and "this machine" in r.json()["error"]["message"]
    local = TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50000))
    assert local.post("/v1/console/turns/retry", json=body).json() == {"dry_run": True, "turns": []}
