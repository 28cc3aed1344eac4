"""`agentq flower`: Flower 2 on agentq's app, guarded by basic auth, showing tool tasks by name."""

from __future__ import annotations

import base64
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.cli.main import flower_argv
from agentq.config import load_settings
from agentq.errors import ConfigError
from agentq.local.processes import ManagedProcess, start_process, wait_for
from agentq.local.redis_server import find_free_port
from agentq.testing.openai_server import Round, ScriptedCall

pytestmark = pytest.mark.integration

AUTH = ("flower-user", "s3cret-" + uuid.uuid4().hex[:6])


def test_flower_argv_binds_loopback_and_passes_auth() -> None:
    s = load_settings(flower_port=5600, flower_basic_auth="u:p")
    argv = flower_argv(s, [], {})
    assert argv == ["flower", "--port=5600", "--address=127.0.0.1", "--basic_auth=u:p"]
    # Flower's own variables and explicit options are honoured, not overridden.
    argv = flower_argv(s, [], {"FLOWER_ADDRESS": "0.0.0.0", "FLOWER_PORT": "5601"})
    assert "--address=0.0.0.0" in argv and not any(a.startswith("--port") for a in argv)
    argv = flower_argv(s, ["--address=10.0.0.5", "--port=7000"], {})
    assert argv[-2:] == ["--address=10.0.0.5", "--port=7000"]
    assert sum(a.startswith(("--address", "--port")) for a in argv) == 2


def test_flower_refuses_to_listen_beyond_loopback_without_auth() -> None:
    open_settings = load_settings(flower_basic_auth=None)
    with pytest.raises(ConfigError) as err:
        flower_argv(open_settings, [], {"FLOWER_ADDRESS": "0.0.0.0"})
    assert err.value.setting == "AGENTQ_FLOWER_BASIC_AUTH"
    assert flower_argv(open_settings, [], {"FLOWER_ADDRESS": "0.0.0.0", "FLOWER_BASIC_AUTH": "a:b"})
    assert flower_argv(open_settings, [], {})  # loopback without auth is fine


@pytest.fixture(scope="module")
def flower(agentq_env: dict[str, str], tool_worker: ManagedProcess) -> Iterator[str]:
    port = find_free_port()
    env = {
        **agentq_env,
        "AGENTQ_FLOWER_PORT": str(port),
        "AGENTQ_FLOWER_BASIC_AUTH": ":".join(AUTH),
    }
    proc = start_process(
        [sys.executable, "-m", "agentq", "flower"],
        env=env,
        ready_pattern=r"Visit me at",
        ready_timeout_s=60,
        name="flower",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(f"{url}/healthcheck") == 200, 30, message="Flower answers")
        yield url
    finally:
        proc.stop()


def _status(url: str, auth: tuple[str, str] | None = None) -> int | None:
    req = urllib.request.Request(url)
    if auth:
        token = base64.b64encode(":".join(auth).encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def test_flower_needs_basic_auth(flower: str) -> None:
    assert _status(f"{flower}/api/tasks") == 401
    assert _status(f"{flower}/api/tasks", ("flower-user", "wrong")) == 401
    assert _status(f"{flower}/api/tasks", AUTH) == 200
    assert _status(f"{flower}/", AUTH) == 200


def test_tool_task_shows_in_flower_by_tool_name(
    flower: str, fleet: Any, llm_server: Any, client: Client
) -> None:
    api = httpx.Client(base_url=flower, auth=AUTH, timeout=5)
    # Flower knows only tasks whose events it received: wait until it hears the tool worker.
    tool_node = str(fleet["tools"].argv[fleet["tools"].argv.index("--hostname") + 1])
    prefix = tool_node.split("@", 1)[0] + "@"

    def hears_tool_worker() -> bool:
        data = api.get("/workers", params={"json": 1}).json()["data"]
        return any(str(w.get("hostname", "")).startswith(prefix) for w in data)

    wait_for(
        hears_tool_worker,
        30,
        interval_s=0.25,
        message="Flower sees the tool worker",
        ignore=(httpx.HTTPError,),
    )

    # The workers run without task events (AGENTQ_TASK_EVENTS is off by default): Flower
    # switches them on by itself (enable_events, every 5 s). Run calls until one shows.
    found: dict[str, Any] = {}

    def run_call_and_find_it() -> dict[str, Any] | None:
        key = f"flower-{uuid.uuid4().hex[:8]}"
        llm_server.set_script(
            key,
            [
                Round(tool_calls=[ScriptedCall(name="echo", arguments={"text": key})]),
                Round(text="ok"),
            ],
        )
        handle = client._start_turn(f"{key} go")
        assert client.wait(handle.turn_id, timeout_s=60).type == "turn_finished"
        (record,) = client.get(handle.turn_id)["invocations"]
        found["record"] = record
        task_id = record["task_id"]
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            tasks = api.get("/api/tasks", params={"taskname": "agentq.tool.echo"}).json()
            task = tasks.get(task_id)
            if task and task.get("state") == "SUCCESS":
                return task  # type: ignore[no-any-return]
            time.sleep(0.1)
        return None

    task = wait_for(
        run_call_and_find_it,
        40,
        interval_s=0.1,
        message="a tool task in Flower",
        ignore=(httpx.HTTPError,),
    )
    record = found["record"]
    task_id = record["task_id"]
    assert task["name"] == "agentq.tool.echo"
    assert task["worker"] == record["worker"]
    assert api.get(f"/api/task/info/{task_id}").json()["name"] == "agentq.tool.echo"
