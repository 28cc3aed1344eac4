"""Turn state on a Redis Cluster (3 masters, a replica each, started by the rig and stopped
by PID), with real workers: turns with tool calls and sub-agents spread over the masters,
the listing merges the shards, aborts and approvals work, and a master killed mid-turn
(its replica promoted) costs nothing: every turn finishes, every call has exactly one
result and ran once."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import httpx
import pytest
from redis.crc import key_slot
from standardwebhooks import Webhook

from agentq import constants as k
from agentq.config import load_settings
from agentq.fleet.runtime import get_app
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.schedules.spec import ScheduleSpec
from agentq.schedules.store import Schedules
from agentq.state.base import active_turns
from agentq.state.listing import TurnLister, TurnQuery
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from agentq.testing.sse import iter_sse
from tests.faults.rig import FAULT_TOOLS, Rig
from tests.helpers import assert_gapless, assert_valid_history, calls, starts, wait_event
from tests.rigs.webhooks import WebhookReceiver, new_secret, webhook_env

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(240)]

TOOLS = f"{FAULT_TOOLS},agentq.testing.aio_tools,agentq.testing.agents"
TURNS = 12


def _cluster_rig(make_rig) -> Rig:  # type: ignore[no-untyped-def]
    rig: Rig = make_rig(cluster=True, AGENTQ_TOOLS=TOOLS)
    assert rig.redis_cluster is not None
    rig.start("tools", "llm", "turns", "io")
    return rig


@pytest.fixture(scope="module")
def cluster_rig() -> Iterator[Rig]:
    """The rig of the tests that break nothing, in file order (the listing test, first,
    counts every turn the cluster holds)."""
    rig = Rig("cluster", cluster=True, AGENTQ_TOOLS=TOOLS)
    try:
        rig.start("tools", "llm", "turns", "io")
        yield rig
    finally:
        rig.close()


def _masters(rig: Rig, turn_ids: list[str]) -> Counter[int]:
    """How many of these turns each master holds."""
    assert rig.redis_cluster is not None
    return Counter(rig.redis_cluster.master_of(k.turn_key(t)).port for t in turn_ids)


def test_turns_subagents_and_the_listing_run_on_a_cluster(cluster_rig: Rig) -> None:
    rig = cluster_rig
    # The state is sharded: one index of each kind a shard, each on its shard's slot.
    assert k.shard_count() == k.DEFAULT_CLUSTER_SHARDS
    turn_id = "ab12" + "0" * 28
    assert key_slot(k.turn_key(turn_id).encode()) == key_slot(
        k.shard_key(k.WAKEUPS, turn_id).encode()
    )
    key = rig.script(
        Round(tool_calls=calls(("echo", {"text": "a"}), ("aio_sleep", {"seconds": 0.2}))),
        Round(text="Done on the cluster."),
    )
    ids = [rig.client._start_turn(f"{key} #{i}").turn_id for i in range(TURNS)]
    # Turn ids are random: a dozen miss one of three masters 2 % of the time. A few more
    # until every master holds one, so the spread is always shown.
    while len(_masters(rig, ids)) < 3 and len(ids) < 4 * TURNS:
        ids.append(rig.client._start_turn(f"{key} #{len(ids)}").turn_id)
    child_key = rig.script(
        Round(tool_calls=calls(("echo", {"text": "from the researcher"}))),
        Round(text="The facts."),
    )
    lead_key = rig.script(
        Round(tool_calls=calls(("researcher", {"prompt": f"{child_key} look it up"}))),
        Round(text="The lead's answer."),
    )
    lead = rig.client._start_turn(lead_key, agent="lead")
    for tid in ids:
        events = rig.collect(tid, timeout_s=60)
        assert events[-1].type == "turn_finished", [e.type for e in events]
        assert events[-1].fields["content"] == "Done on the cluster."
        assert_gapless(rig.log_events(tid))
        turn = rig.client.get(tid)
        assert sorted(r["status"] for r in turn["invocations"]) == ["ok", "ok"]
        assert_valid_history(turn["history"])
    assert len(_masters(rig, ids)) == 3  # the turns spread over every master

    relayed = rig.collect(lead.turn_id, timeout_s=60)
    assert relayed[-1].type == "turn_finished", [e.type for e in relayed]
    (started,) = [e for e in relayed if e.type == "tool_started" and not e.path]
    child = started.fields["child_turn_id"]
    # The child lives in its parent's shard: its end settled the parent's call atomically.
    assert k.shard_of(child) == k.shard_of(lead.turn_id)
    assert {tuple(e.path) for e in relayed if e.path} == {(child,)}
    assert [
        m["content"] for m in rig.client.get(lead.turn_id)["history"] if m["role"] == "tool"
    ] == ["The facts."]

    # The listing merges every shard's index, newest first, and pages across them.
    lister = TurnLister(rig.client._store.redis)
    everyone = {lead.turn_id, child, *ids}
    page = lister.page(TurnQuery(limit=5))
    seen = [t["turn_id"] for t in page.turns]
    while page.next_before is not None:
        page = lister.page(TurnQuery(limit=5, before=page.next_before))
        seen += [t["turn_id"] for t in page.turns]
    assert set(seen) == everyone and len(seen) == len(everyone)
    created = [rig.client.get(t)["state"]["created_at"] for t in seen]
    assert created == sorted(created, reverse=True)
    assert active_turns(rig.client._store.redis) == []

    # The gateway on the cluster: a turn over HTTP, its events over SSE (a shard channel),
    # the active list and the fleet's metrics.
    with (
        BackgroundServer(create_app(rig.client)) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        r = http.post("/v1/turns", json={"prompt": f"{key} over http"})
        assert r.status_code == 202, r.text
        started_http = r.json()
        headers = {"Authorization": f"Bearer {started_http['token']}"}
        with http.stream("GET", started_http["events_url"], headers=headers) as resp:
            assert resp.status_code == 200
            types = [m.event for m in iter_sse(resp) if m.id is not None]
        assert types[0] == "turn_started" and types[-1] == "turn_finished", types
        assert types.count("tool_finished") == 2
        assert http.get("/v1/turns/active").json() == {"turns": []}
        got = http.get(f"/v1/turns/{started_http['turn_id']}", headers=headers).json()
        assert got["state"]["status"] == "finished"
        # Counted by the processes that published the events, in one hash of the Cluster.
        ended = 'agentq_turns_ended_total{outcome="finished"}'
        wait_for(
            lambda: any(
                line.startswith(ended) and float(line.split()[-1]) >= 1
                for line in http.get("/metrics").text.splitlines()
            ),
            15,
            message="the gateway to count the finished turn",
        )


def test_aborts_and_approvals_on_a_cluster(cluster_rig: Rig) -> None:
    rig = cluster_rig
    # Approved, denied by its timeout, and aborted mid-call: three turns on any masters.
    approve_key = rig.script(
        Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))), Round(text="deleted")
    )
    quick_key = rig.script(
        Round(tool_calls=calls(("ask_quick", {"note": "a"}))), Round(text="it was denied")
    )
    hang_key = rig.script(Round(tool_calls=calls(("hang", {"seconds": 60}))))
    approved = rig.client._start_turn(approve_key)
    quick = rig.client._start_turn(quick_key)
    hung = rig.client._start_turn(hang_key)

    req = wait_event(rig.client, approved.turn_id, "interaction_requested")
    # The console's list of pending interactions reads every shard's running turns.
    pending = TurnLister(rig.client._store.redis).pending_interactions()
    assert req.fields["request_id"] in {p["request_id"] for p in pending}
    rig.client.answer(approved.turn_id, req.fields["request_id"], approved.token, "approve")

    wait_event(rig.client, hung.turn_id, "tool_started")
    t0 = time.monotonic()
    rig.client.abort(hung.turn_id, hung.token)
    aborted = rig.collect(hung.turn_id, timeout_s=30)
    assert aborted[-1].type == "turn_aborted", [e.type for e in aborted]
    assert time.monotonic() - t0 < 15
    (settled,) = [e for e in aborted if e.type == "tool_finished"]
    assert settled.fields["status"] == "cancelled"
    assert_valid_history(rig.client.get(hung.turn_id)["history"])

    done = rig.collect(approved.turn_id, timeout_s=30)
    assert done[-1].type == "turn_finished"
    assert [e.fields["status"] for e in done if e.type == "tool_finished"] == ["ok"]
    denied = rig.collect(quick.turn_id, timeout_s=30)
    types = [e.type for e in denied]
    assert "interaction_timed_out" in types and types[-1] == "turn_finished", types
    tool_msg = next(m for m in rig.client.get(quick.turn_id)["history"] if m["role"] == "tool")
    assert json.loads(tool_msg["content"])["status"] == "denied"
    assert active_turns(rig.client._store.redis) == []


def test_a_master_killed_mid_turn_loses_nothing(make_rig, tmp_path: Path) -> None:
    rig = _cluster_rig(make_rig)
    assert rig.redis_cluster is not None
    counts = [tmp_path / f"count{i}" for i in range(2)]
    key = rig.script(
        Round(
            tool_calls=calls(
                ("counted", {"path": str(counts[0]), "seconds": 2}),
                ("aio_sleep", {"seconds": 1.0}),
            )
        ),
        Round(tool_calls=calls(("counted", {"path": str(counts[1]), "seconds": 0.5}))),
        Round(text="Finished across the failover."),
    )
    handles = [rig.client._start_turn(f"{key} #{i}") for i in range(TURNS)]
    ids = [h.turn_id for h in handles]
    follower, seen = rig.follow(ids[0], timeout_s=120)
    wait_for(lambda: starts(counts[0]) == TURNS, 60, message="every turn's slow call to start")

    # The master holding the followed turn dies (SIGKILL) while its calls run.
    before = {t: rig.redis_cluster.master_of(k.turn_key(t)).port for t in ids}
    dead = rig.redis_cluster.fail_master_of(k.turn_key(ids[0]))
    on_dead = [t for t in ids if before[t] == dead.port]
    assert ids[0] in on_dead and rig.redis_cluster.master_of(k.turn_key(ids[0])) is not dead

    redis = rig.client._store.redis

    def ended() -> bool:
        return all(json.loads(redis.hget(k.turn_key(t), "status")) == "finished" for t in ids)

    try:
        wait_for(ended, 120, interval_s=0.5, message="every turn to finish")
    except AssertionError:
        raise AssertionError(_explain(rig, ids)) from None
    for tid in ids:
        events = rig.collect(tid, timeout_s=30)
        assert events[-1].type == "turn_finished", (tid, [e.type for e in events])
        assert events[-1].fields["content"] == "Finished across the failover."
        log = rig.log_events(tid)
        finished = [e.fields for e in log if e.type == "tool_finished"]
        assert len({f["call_id"] for f in finished}) == len(finished) == 3, finished
        assert all(f["status"] == "ok" for f in finished), finished
        assert_valid_history(rig.client.get(tid)["history"])
    follower.join(60)
    assert not follower.is_alive()
    assert seen[-1].type == "turn_finished", [e.type for e in seen]
    # Every non-idempotent call ran once per turn.
    assert [starts(p) for p in counts] == [TURNS, TURNS]


def _explain(rig: Rig, ids: list[str]) -> str:
    """The state, wakeup and last events of the turns that did not finish."""
    redis = rig.client._store.redis
    lines = []
    for tid in ids:
        state = {f.decode(): v.decode()[:160] for f, v in redis.hgetall(k.turn_key(tid)).items()}
        if json.loads(state.get("status", "null")) == "finished":
            continue
        wake = redis.zscore(k.shard_key(k.WAKEUPS, tid), tid)
        last = [(e.type, str(e.fields)[:120]) for e in rig.log_events(tid)[-5:]]
        lines.append(f"{tid}: wakeup={wake} now={time.time():.1f} state={state} last={last}")
    return "\n".join(lines)


SECRET = new_secret()
HOOK_ENV = {**webhook_env(SECRET), "AGENTQ_BEAT_MAX_INTERVAL_S": "0.25"}


def test_webhooks_and_schedules_on_a_cluster(make_rig) -> None:
    rig: Rig = make_rig(cluster=True, AGENTQ_TOOLS=TOOLS, **HOOK_ENV)
    rig.start("tools", "llm", "turns", "io")
    # The beat's own schedule is on the plain Redis (celery-redbeat does not speak
    # Cluster); the schedules and their runs are on the cluster.
    rig.fleet.start(
        "beat", [sys.executable, "-m", "agentq", "beat"], ready_pattern="beat: Acquired lock"
    )
    key = rig.script(Round(text="Reported from the cluster."))
    with WebhookReceiver([500, 200]) as rx:
        handle = rig.client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        first, second = rx.wait(2)
        body = Webhook(SECRET).verify(second.body, second.headers)
        assert first.headers["webhook-id"] == second.headers["webhook-id"]
        assert body["type"] == "turn.finished" and body["data"]["turn_id"] == handle.turn_id
        assert body["data"]["output_text"] == "Reported from the cluster."

    redis = rig.client._store.redis
    schedules = Schedules(get_app(), redis, load_settings())
    schedules.add(ScheduleSpec(name="report", every_s=1, prompt=f"{key} report"))

    def fired() -> int:
        return int(redis.hget(k.schedule_key("report"), "fired") or 0)

    wait_for(lambda: fired() >= 2, 30, message="two ticks of the schedule")
    last = redis.hget(k.schedule_key("report"), "last_turn_id")
    assert last is not None
    done = rig.collect(last.decode(), timeout_s=30)
    assert done[-1].type == "turn_finished"
    assert rig.client.get(last.decode())["state"]["schedule"] == "report"
    schedules.remove("report")


def test_a_conversation_runs_one_turn_at_a_time_on_a_cluster(cluster_rig: Rig) -> None:
    rig = cluster_rig
    key = rig.script(
        Round(tool_calls=calls(("echo", {"text": "a"}), ("aio_sleep", {"seconds": 0.5}))),
        Round(text="first"),
        Round(tool_calls=calls(("aio_sleep", {"seconds": 2.0}))),
        Round(text="joined"),
        Round(text="third"),
    )
    conv = f"cluster-{uuid.uuid4().hex[:8]}"
    c = rig.client
    first = c._start_turn(key, conversation_id=conv, operator=True)
    second = c._start_turn("second", conversation_id=conv, operator=True)
    assert second.queued and second.behind == first.turn_id
    rig.collect(second.turn_id, until=lambda e: e.type == "tool_started", timeout_s=60)
    joined = c._start_turn("and this", conversation_id=conv, operator=True, multitask="inject")
    assert joined.injected and joined.turn_id == second.turn_id
    third = c._start_turn("third", conversation_id=conv, operator=True)
    assert rig.collect(third.turn_id, timeout_s=60)[-1].fields["content"] == "third"
    view = c.conversation(conv, operator=True)
    assert view["status"] == "idle" and view["queued"] == []
    users = [m["content"] for m in view["messages"] if m["role"] == "user"]
    assert users == [key, "second", "and this", "third"]
    assert_valid_history(view["messages"])
    # The conversation's keys share one slot; its turns are spread over the shards.
    parts = get_args(k.ConversationPart)
    slots = {key_slot(k.conversation_key(conv, part).encode()) for part in parts}
    assert len(slots) == 1
    assert conv in [r["conversation_id"] for r in c.conversations(operator=True)]


def test_a_turns_budget_holds_on_a_cluster(make_rig) -> None:
    # A small completion reservation, so the budget binds after a few rounds.
    rig: Rig = make_rig(cluster=True, AGENTQ_TOOLS=TOOLS, AGENTQ_BUDGET_COMPLETION_TOKENS="64")
    rig.start("tools", "llm", "turns", "io")
    rounds = [Round(tool_calls=calls(("echo", {"text": f"r{i}"}))) for i in range(30)]
    key = rig.script(*rounds, Round(text="done"))
    handle = rig.client._start_turn(f"{key} go", max_tokens=6000)
    events = rig.collect(handle.turn_id, timeout_s=60)
    end = events[-1]
    assert end.type == "turn_error" and end.fields["code"] == "budget_exceeded"
    assert end.fields["scope"] == "turn" and end.fields["spent"] <= 6000
    assert len([e for e in events if e.type == "llm_finished"]) >= 2
    view = rig.client.get(handle.turn_id)
    assert_valid_history(view["history"])
    assert 0 < view["spend"]["total_tokens"] <= 6000
    # Recorded as usage of the day, across the cluster's shards.
    totals = rig.client.usage()["totals"]
    assert totals["prompt_tokens"] > 0 and totals["turns"] >= 1
