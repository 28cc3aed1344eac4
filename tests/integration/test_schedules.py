"""Schedules through real beats (`agentq beat` processes), real turn workers and Redis:
ticks start turns, two beats start one turn per tick, a restarted beat carries on, a
missed tick fires once, a schedule whose turn still runs skips its tick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from redbeat import RedBeatSchedulerEntry

from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.fleet.runtime import get_app, get_store
from agentq.gateway import create_app
from agentq.local.processes import ManagedProcess, run_process, start_process, wait_for
from agentq.orchestrator.scheduled import run_tick, tick_turn_id
from agentq.schedules.spec import ScheduleSpec
from agentq.schedules.store import Schedules
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from tests.helpers import calls, script

pytestmark = pytest.mark.integration

BEAT_ENV = {"AGENTQ_BEAT_MAX_INTERVAL_S": "0.25"}
ALICE_KEY = "alice-" + uuid.uuid4().hex
ADMIN_KEY = "ops-" + uuid.uuid4().hex


class Beats:
    """`agentq beat` processes of one test, stopped (by PID) at its end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {**env, **BEAT_ENV}
        self.procs: list[ManagedProcess] = []

    def start(self, *, holds_lock: bool = True) -> ManagedProcess:
        # The first beat says it acquired the lock; a second one waits for it, silently.
        pattern = "beat: Acquired lock" if holds_lock else "beat: Starting"
        proc = start_process(
            [sys.executable, "-m", "agentq", "beat"],
            env=self.env,
            ready_pattern=pattern,
            name="beat",
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture()
def beats(agentq_env: dict[str, str]) -> Iterator[Beats]:
    b = Beats(agentq_env)
    yield b
    b.stop()


@pytest.fixture()
def schedules(agentq_env: dict[str, str]) -> Iterator[Schedules]:
    s = Schedules(get_app(), get_store().redis, load_settings())
    yield s
    for item in s.list():
        s.remove(item["name"])


def runs(name: str) -> dict[str, str]:
    raw = get_store().redis.hgetall(k.schedule_key(name))
    return {f.decode(): v.decode() for f, v in raw.items()}


def turns_of(name: str) -> list[dict[str, Any]]:
    store = get_store()
    out = []
    for tid in store.redis.zrange(k.TURNS_INDEX, 0, -1):
        state = store.state(tid.decode())
        if state and state.get("schedule") == name:
            out.append(state)
    return out


def tick_keys(name: str) -> list[bytes]:
    return list(get_store().redis.scan_iter(k.schedule_key(name, "*")))


def test_ticks_start_turns_that_finish(
    fleet, llm_server, beats: Beats, schedules: Schedules
) -> None:
    key = script(llm_server, Round(text="Morning report: all quiet."))
    schedules.add(ScheduleSpec(name="report", every_s=1, prompt=f"{key} report"))
    beats.start()
    wait_for(lambda: int(runs("report").get("fired", 0)) >= 2, 20)
    first = runs("report")["last_turn_id"]
    turn = Client().wait(first, timeout_s=20)
    assert turn.type == "turn_finished"
    assert Client().get(first)["state"]["schedule"] == "report"
    listed = {s["name"]: s for s in schedules.list()}
    assert listed["report"]["fired"] >= 2 and listed["report"]["when"] == "every 1s"


def test_two_beats_and_a_beat_restart_start_one_turn_per_tick(
    fleet, beats: Beats, schedules: Schedules
) -> None:
    schedules.add(ScheduleSpec(name="twice", every_s=1, prompt="hello", overlap=True))
    first = beats.start()
    second = beats.start(holds_lock=False)
    wait_for(lambda: int(runs("twice").get("fired", 0)) >= 2, 20)
    # celery-redbeat's lock: the second beat sends nothing while the first holds it.
    assert "Sending due task" not in second.log_text()
    assert "Acquired lock" not in second.log_text()
    # The beat holding the lock dies without letting go: the other one takes over once
    # the lock lapses, and the ticks go on.
    first.kill()
    fired = int(runs("twice")["fired"])
    wait_for(lambda: "Acquired lock" in second.log_text(), 20)
    wait_for(lambda: int(runs("twice").get("fired", 0)) >= fired + 2, 20)
    # A third beat, started after, waits for the lock like the second did.
    beats.start(holds_lock=False)
    wait_for(lambda: int(runs("twice").get("fired", 0)) >= fired + 3, 20)
    # No more ticks: a tick is claimed, then its turn started, then counted, so the three
    # agree only once the last one sent has gone through; a tick with two turns, or
    # none, never lets them agree.
    beats.stop()

    def agreed() -> list[dict[str, Any]] | None:
        turns = turns_of("twice")
        same = len(turns) == len(tick_keys("twice")) == int(runs("twice")["fired"])
        return turns if same else None

    turns = wait_for(agreed, 20, message="one turn per claimed tick, each counted as fired")
    assert len({t["created_at"] for t in turns}) == len(turns)


def test_one_tick_sent_twice_starts_one_turn(fleet, schedules: Schedules) -> None:
    """What two beats that both fired the same tick do: the second message starts nothing."""
    schedules.add(ScheduleSpec(name="dup", every_s=3600, prompt="hello", overlap=True))
    store, app, settings = get_store(), get_app(), load_settings()
    outcomes = [run_tick(store, app, settings, "dup", "1700000000000") for _ in range(2)]
    assert outcomes == ["started", "duplicate"]
    assert len(turns_of("dup")) == 1
    assert store.state(tick_turn_id("dup", "1700000000000")) is not None


def test_ticks_missed_while_no_beat_ran_fire_once(
    fleet, beats: Beats, schedules: Schedules
) -> None:
    schedules.add(ScheduleSpec(name="missed", every_s=60, prompt="hello", overlap=True))
    app = schedules.app
    entry = RedBeatSchedulerEntry.from_key(RedBeatSchedulerEntry.generate_key(app, "missed"), app)
    # Ten ticks were due while no beat ran.
    entry.reschedule(last_run_at=datetime.now(timezone.utc) - timedelta(minutes=10))
    beats.start()
    wait_for(lambda: int(runs("missed").get("fired", 0)) >= 1, 20)
    # Once fired, the next tick is a period away: nothing else is due.
    wait_for(
        lambda: (
            (s := get_store().redis.zscore(app.redbeat_conf.schedule_key, entry.key))
            and s > time.time() + 50
        ),
        10,
    )
    assert int(runs("missed")["fired"]) == 1 and len(turns_of("missed")) == 1


def test_a_tick_is_skipped_while_the_last_turn_runs(
    fleet, llm_server, beats: Beats, schedules: Schedules
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 30}))))
    schedules.add(ScheduleSpec(name="slow", every_s=1, prompt=f"{key} slow"))
    beats.start()
    wait_for(lambda: int(runs("slow").get("skipped", 0)) >= 2, 20)
    assert int(runs("slow")["fired"]) == 1
    last = runs("slow")["last_turn_id"]
    assert get_store().status(last) in ("queued", "running")
    schedules.remove("slow")
    Client().abort(last, None, operator=True)


def agentq_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_process([sys.executable, "-m", "agentq", *args], env=env)


def test_schedule_commands(agentq_env: dict[str, str], schedules: Schedules) -> None:
    env = {**os.environ, **agentq_env}
    ok = agentq_cli(
        "schedule", "add", "daily", "--cron", "0 7 * * *", "--agent", "x", "hi", env=env
    )
    assert ok.returncode == 0 and "added daily: cron 0 7 * * *" in ok.stdout, ok.stderr
    listed = agentq_cli("schedule", "list", "--json", env=env)
    (row,) = json.loads(listed.stdout)["schedules"]
    assert row["name"] == "daily" and row["agent"] == "x" and row["next_at"] > time.time()
    again = agentq_cli("schedule", "add", "daily", "--every", "30s", "hi", env=env)
    assert again.returncode == 2 and "exists already" in again.stderr
    bad = agentq_cli("schedule", "add", "b", "--every", "soon", "hi", env=env)
    assert bad.returncode == 2 and "--every 'soon'" in bad.stderr
    cron = agentq_cli("schedule", "add", "c", "--cron", "99 * * * *", "hi", env=env)
    assert cron.returncode == 2 and "Invalid end range" in cron.stderr
    gone = agentq_cli("schedule", "remove", "daily", env=env)
    assert gone.returncode == 0
    missing = agentq_cli("schedule", "remove", "daily", env=env)
    assert missing.returncode == 1 and "no schedule named 'daily'" in missing.stderr


def test_schedules_over_http_are_for_admin_keys(agentq_env: dict[str, str], schedules) -> None:
    settings = load_settings(api_keys=f"alice={ALICE_KEY}", admin_keys=f"ops={ADMIN_KEY}")
    with (
        BackgroundServer(create_app(Client(settings))) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        alice = {"Authorization": f"Bearer {ALICE_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        body = {"name": "nightly", "cron": "0 2 * * *", "prompt": "tidy up"}
        assert http.post("/v1/schedules", json=body, headers=alice).status_code == 403
        assert http.get("/v1/schedules", headers=alice).status_code == 403
        assert http.post("/v1/schedules", json=body).status_code == 401
        made = http.post("/v1/schedules", json=body, headers=admin)
        assert made.status_code == 201, made.text
        assert made.json()["owner"] == "ops" and made.json()["when"] == "cron 0 2 * * *"
        bad = http.post(
            "/v1/schedules", json={"name": "b", "every": "1ms", "prompt": "x"}, headers=admin
        )
        assert bad.status_code == 422 and "at least 1s" in bad.json()["error"]["message"]
        both = http.post(
            "/v1/schedules",
            json={"name": "b", "every": "5m", "cron": "* * * * *", "prompt": "x"},
            headers=admin,
        )
        assert both.status_code == 422 and "not both" in both.json()["error"]["message"]
        (row,) = http.get("/v1/schedules", headers=admin).json()["schedules"]
        assert row["name"] == "nightly" and row["fired"] == 0
        assert http.delete("/v1/schedules/nightly", headers=alice).status_code == 403
        assert http.delete("/v1/schedules/nightly", headers=admin).status_code == 200
        gone = http.delete("/v1/schedules/nightly", headers=admin)
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "ScheduleNotFound"
