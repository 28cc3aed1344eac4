"""The broker goes away under running turns: a RabbitMQ restarted or killed, a Redis broker
(separate from the state Redis) restarted.

No outage fails or strands a turn that has time left: a step, call or model round whose
publish fails stays pending in Redis (the turn's wakeup) and is sent again when the broker
is back; workers reconnect and consume again; a message delivered twice runs once.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from agentq import constants as k
from agentq.fleet.health import HEALTH_EVERY_S
from agentq.local.processes import wait_for
from agentq.local.redis_server import RedisServer
from agentq.testing.openai_server import Round
from tests.faults.rig import Rig
from tests.helpers import assert_valid_history, calls
from tests.rigs.rabbitmq import RabbitServer, find_rabbitmq_server

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(240)]

TURNS = 24
OUTAGE_S = 4.0
"""How long the broker stays away: longer than kombu's publish retries (about 1 s)."""
FINISH_BOUND_S = 150.0
TERMINAL = ("finished", "aborted", "error")


@pytest.fixture()
def rabbit() -> Iterator[RabbitServer]:
    if find_rabbitmq_server() is None:
        pytest.skip("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    server = RabbitServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def broker_redis() -> Iterator[RedisServer]:
    server = RedisServer(appendonly=True).start()
    try:
        yield server
    finally:
        server.stop()


def _start_turns(rig: Rig) -> list[str]:
    """Turns of three rounds: two of tool calls (1 s and 0.5 s) and a closing text."""
    key = rig.script(
        Round(tool_calls=calls(("sleep", {"seconds": 1.0}), ("echo", {"text": "a"}))),
        Round(tool_calls=calls(("sleep", {"seconds": 0.5}))),
        Round(text="Done after the outage."),
    )
    return [rig.client._start_turn(f"{key} #{i}").turn_id for i in range(TURNS)]


def _statuses(rig: Rig, ids: list[str]) -> list[str | None]:
    pipe = rig.client._store.redis.pipeline()
    for tid in ids:
        pipe.hget(k.turn_key(tid), "status")
    return [None if s is None else json.loads(s) for s in pipe.execute()]


def _outage_under_load(rig: Rig, outage: Callable[[], None]) -> None:
    ids = _start_turns(rig)
    # Mid-flight: some turns have calls running, others still wait for their first step.
    wait_for(
        lambda: sum(bool(rig.client._store.results(t)) for t in ids) >= 3,
        60,
        message="the first results",
    )
    outage()
    t0 = time.monotonic()
    try:
        wait_for(
            lambda: all(s in TERMINAL for s in _statuses(rig, ids)),
            FINISH_BOUND_S,
            interval_s=0.5,
            message="every turn to end after the outage",
        )
    except AssertionError:
        stuck = [t for t, s in zip(ids, _statuses(rig, ids), strict=True) if s not in TERMINAL]
        raise AssertionError(f"turns not ended: {_explain(rig, stuck)}") from None
    statuses = _statuses(rig, ids)
    failed = [t for t, s in zip(ids, statuses, strict=True) if s != "finished"]
    assert not failed, _explain(rig, failed)
    for tid in ids:
        turn = rig.client.get(tid)
        assert_valid_history(turn["history"])
        # Every call has exactly one result, run once.
        assert [r["status"] for r in turn["invocations"]] == ["ok"] * 3, (tid, turn["invocations"])
        assert [r["attempt"] for r in turn["invocations"]] == [1, 1, 1]
        assert turn["history"][-1]["content"] == "Done after the outage."
    print(f"\n{TURNS} turns finished {time.monotonic() - t0:.1f} s after the outage ended")


def _explain(rig: Rig, ids: list[str]) -> str:
    """What a test failure needs to know of these turns: state, wakeup, last events."""
    redis = rig.client._store.redis
    lines = []
    for tid in ids:
        state = {kk.decode(): v.decode()[:200] for kk, v in redis.hgetall(k.turn_key(tid)).items()}
        wake = redis.zscore(k.WAKEUPS, tid)
        events = [
            (e.type, {f: str(v)[:80] for f, v in e.fields.items()})
            for e in rig.log_events(tid)[-6:]
        ]
        lines.append(f"{tid}: wakeup={wake} now={time.time():.1f} state={state} last={events}")
    return "\n".join(lines)


def _outage(stop: Callable[[], None], start: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        stop()
        time.sleep(OUTAGE_S)  # the outage itself: the broker is away this long
        start()

    return run


def test_rabbitmq_restart_under_load_fails_no_turn(make_rig, rabbit: RabbitServer) -> None:
    rig = make_rig(AGENTQ_BROKER_URL=rabbit.url)
    rig.start("tools", "llm", "turns", concurrency={"turns": 16, "tools": 4})
    _outage_under_load(rig, _outage(lambda: rabbit.stop(keep_data=True), rabbit.start))


def test_rabbitmq_killed_under_load_fails_no_turn(make_rig, rabbit: RabbitServer) -> None:
    rig = make_rig(AGENTQ_BROKER_URL=rabbit.url)
    rig.start("tools", "llm", "turns", concurrency={"turns": 16, "tools": 4})
    _outage_under_load(rig, _outage(rabbit.kill, rabbit.start))


def test_redis_broker_restart_under_load_fails_no_turn(make_rig, broker_redis: RedisServer) -> None:
    rig = make_rig(AGENTQ_BROKER_URL=broker_redis.url)
    rig.start("tools", "llm", "turns", concurrency={"turns": 16, "tools": 4})
    _outage_under_load(rig, _outage(broker_redis.halt, broker_redis.start))


def test_calls_a_worker_held_unstarted_go_back_when_the_broker_returns(
    make_rig, broker_redis: RedisServer
) -> None:
    """A worker holds calls it received and has not started (here: it prefetches four, and
    runs one at a time); its broker restarts. Celery drops them as the connection breaks,
    kombu cannot put them back through a broker that is away, and without kombu's unacked
    hash nothing would: agentq keeps them and puts them back when the broker returns, so
    each runs, once, instead of settling `lost` after the queue timeout."""
    rig = make_rig(AGENTQ_BROKER_URL=broker_redis.url, AGENTQ_TOOL_QUEUE_TIMEOUT_S="120")
    rig.start("llm", "turns")
    rig.start("tools", concurrency={"tools": 1}, extra_args=("--prefetch-multiplier", "4"))
    key = rig.script(
        # Four different calls: the same one four times would be stopped as a loop.
        Round(tool_calls=calls(*[("sleep", {"seconds": 2 + i / 100}) for i in range(4)])),
        Round(text="All four ran."),
    )
    turn_id = rig.client._start_turn(key).turn_id
    broker = redis.Redis.from_url(broker_redis.url)
    # One call runs; the other three left the queue for the worker, which holds them.
    wait_for(
        lambda: (
            len(rig.client._store.call_progress(turn_id)[0]) == 1
            and broker.llen(k.QUEUE_TOOLS) == 0
        ),
        30,
        message="one call running, three held by the worker",
    )
    broker_redis.halt()
    time.sleep(OUTAGE_S)
    broker_redis.start()
    wait_for(
        lambda: _statuses(rig, [turn_id]) == ["finished"],
        60,
        interval_s=0.5,
        message="the turn to finish after the broker returned",
    )
    turn = rig.client.get(turn_id)
    assert_valid_history(turn["history"])
    assert [r["status"] for r in turn["invocations"]] == ["ok"] * 4, [
        (r["call_id"], r["status"], r.get("error")) for r in turn["invocations"]
    ]
    assert [r["attempt"] for r in turn["invocations"]] == [1, 1, 1, 1]
    # Those held, and the running one's (which its start claim refuses to run again).
    assert re.search(r"put [34] messages back on the broker", rig.logs())


def test_turn_started_while_the_broker_is_down_runs_when_it_is_back(
    make_rig, rabbit: RabbitServer
) -> None:
    rig = make_rig(AGENTQ_BROKER_URL=rabbit.url)
    rig.start("tools", "llm", "turns", concurrency={"turns": 4, "tools": 2})
    key = rig.script(
        Round(tool_calls=calls(("echo", {"text": "queued in Redis"}))), Round(text="Started late.")
    )
    rabbit.stop(keep_data=True)
    # Starting a turn does not fail: it is stored, and its wakeup is the message not sent.
    handle = rig.client._start_turn(key)
    redis = rig.client._store.redis
    wake = redis.zscore(k.WAKEUPS, handle.turn_id)
    assert wake is not None and wake <= time.time() + 2, wake
    assert _statuses(rig, [handle.turn_id]) == ["queued"]
    rabbit.start()
    events = rig.collect(handle.turn_id, timeout_s=90)
    assert events[-1].type == "turn_finished", [e.type for e in events]
    turn = rig.client.get(handle.turn_id)
    assert [r["status"] for r in turn["invocations"]] == ["ok"]
    assert turn["history"][-1]["content"] == "Started late."


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def test_health_file_is_fresh_only_while_the_worker_has_its_broker(
    make_rig, broker_redis: RedisServer, tmp_path: Path
) -> None:
    health = tmp_path / "health"
    rig = make_rig(AGENTQ_BROKER_URL=broker_redis.url, AGENTQ_HEALTH_FILE=str(health))
    rig.start("turns", concurrency={"turns": 2})
    first = wait_for(lambda: health.exists() and health.stat().st_mtime, 30)
    wait_for(lambda: health.stat().st_mtime > first, 3 * HEALTH_EVERY_S, interval_s=0.2)
    broker_redis.halt()
    wait_for(lambda: _age_s(health) > 2 * HEALTH_EVERY_S, 6 * HEALTH_EVERY_S, interval_s=0.5)
    broker_redis.start()
    wait_for(lambda: _age_s(health) < HEALTH_EVERY_S, 60, interval_s=0.5)
    rig.fleet.stop()
    assert not health.exists()  # a stopped worker is not healthy
