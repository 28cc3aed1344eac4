"""`agentq turns` and `agentq show` as subprocesses against a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from agentq.api import Client
from agentq.local.processes import run_process
from agentq.models import TurnStatus

pytestmark = pytest.mark.integration


def agentq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_process([sys.executable, "-m", "agentq", *args], env=env)


def test_turns_json_table_and_show(agentq_env: dict[str, str], client: Client) -> None:
    import os

    env = {**os.environ, **agentq_env, "COLUMNS": "200"}
    agent = f"cli-{uuid.uuid4().hex[:8]}"
    store = client._store
    ids = []
    for i, status in enumerate(["running", "finished"]):
        turn_id = uuid.uuid4().hex
        store.create(
            turn_id, {"status": "queued", "created_at": time.time() + i, "agent": agent}, []
        )
        store.update(turn_id, status="running", started_at=time.time())
        if status == "finished":
            store.close(turn_id, TurnStatus.FINISHED, "turn_finished", {})
        ids.append(turn_id)
    out = agentq(env, "turns", "--json", "--agent", agent)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert [t["turn_id"] for t in body["turns"]] == [ids[1], ids[0]]
    out = agentq(env, "turns", "--json", "--agent", agent, "--status", "finished")
    assert [t["turn_id"] for t in json.loads(out.stdout)["turns"]] == [ids[1]]
    out = agentq(env, "turns", "--agent", agent)
    assert out.returncode == 0 and ids[0][:12] in out.stdout and "finished" in out.stdout
    assert agentq(env, "turns", "--status", "sleeping").returncode == 2
    out = agentq(env, "show", ids[1])
    assert out.returncode == 0 and ids[1] in out.stdout and "finished" in out.stdout
    assert agentq(env, "show", "no-such-turn").returncode == 1


def _stored_turn(client: Client, turn_id: str, agent: str, *, finished: bool) -> None:
    store = client._store
    store.create(turn_id, {"status": "queued", "created_at": time.time(), "agent": agent}, [])
    store.update(turn_id, status="running", started_at=time.time())
    if finished:
        store.close(turn_id, TurnStatus.FINISHED, "turn_finished", {})


def test_short_ids_in_the_table_and_prefixes_on_the_command_line(
    fleet: object, agentq_env: dict[str, str], client: Client
) -> None:
    import os

    env = {**os.environ, **agentq_env, "COLUMNS": "80"}
    agent = f"cli-{uuid.uuid4().hex[:8]}"
    stem = uuid.uuid4().hex[:10]
    done = stem + "0" + uuid.uuid4().hex[:21]
    running = stem + "1" + uuid.uuid4().hex[:21]
    _stored_turn(client, done, agent, finished=True)
    _stored_turn(client, running, agent, finished=False)

    table = agentq(env, "turns", "--agent", agent)
    assert table.returncode == 0, table.stderr
    assert done[:12] in table.stdout and running[:12] in table.stdout
    assert done not in table.stdout and "…" not in table.stdout, table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    listed = json.loads(agentq(env, "turns", "--json", "--agent", agent).stdout)["turns"]
    assert {t["turn_id"] for t in listed} == {done, running}  # --json keeps full ids

    shown = agentq(env, "show", done[:12])
    assert shown.returncode == 0 and done in shown.stdout, shown.stderr
    events = agentq(env, "events", done[:12].upper())
    assert events.returncode == 0, events.stderr
    assert json.loads(events.stdout.splitlines()[-1])["turn_id"] == done

    # A prefix of both: nothing happens, exit 2, both listed (newest first) with status.
    for args in (("show", stem), ("abort", stem), ("answer", stem, "r-1", "approve")):
        out = agentq(env, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "ambiguous" in out.stderr and done in out.stderr and running in out.stderr
        assert out.stderr.index(running) < out.stderr.index(done)
    assert client._store.status(running) == "running"

    aborted = agentq(env, "abort", running[:11])
    assert aborted.returncode == 0, aborted.stderr
    assert aborted.stdout.strip() == f"aborted {running}"
    assert client._store.status(running) == "aborted"

    # A prefix of no turn behaves as an unknown id does: exit 1, named as typed.
    unknown = uuid.uuid4().hex
    for typed in (unknown, unknown[:12]):
        out = agentq(env, "show", typed)
        assert out.returncode == 1 and f"turn {typed} is unknown" in out.stderr, out.stderr
        assert agentq(env, "abort", typed).returncode == 1
