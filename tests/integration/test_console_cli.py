"""`agentq turns` and `agentq show` as subprocesses against a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from agentq.api import Client
from agentq.models import TurnStatus

pytestmark = pytest.mark.integration


def agentq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_turns_json_table_and_show(agentq_env: dict[str, str], client: Client) -> None:
    import os

    env = {**os.environ, **agentq_env, "COLUMNS": "200"}
    agent = f"cli-{uuid.uuid4().hex[:8]}"
    store = client.store
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
    assert out.returncode == 0 and ids[0] in out.stdout and "finished" in out.stdout
    assert agentq(env, "turns", "--status", "sleeping").returncode == 2
    out = agentq(env, "show", ids[1])
    assert out.returncode == 0 and ids[1] in out.stdout and "finished" in out.stdout
    assert agentq(env, "show", "no-such-turn").returncode == 1
