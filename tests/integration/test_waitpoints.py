"""Waitpoints with real workers: a tool ends its run with a wait, the call stays open
holding no process, and a completion from another process (the CLI, the gateway) settles
it exactly once; its deadline settles it `timeout`, an abort `cancelled`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from agentq import constants as k
from agentq.api import Client
from agentq.errors import AnswerInvalid, WaitpointRefused
from agentq.events import Event
from agentq.gateway import create_app
from agentq.local.processes import wait_for
from agentq.models import TurnHandle
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from tests.helpers import agentq_cli, assert_valid_history, calls, collect, script, wait_event

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client())) as server:
        yield server


@pytest.fixture()
def http(gateway: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=httpx.Timeout(30.0)) as c:
        yield c


def waiting_turn(
    client: Client, llm_server: Any, tool: str = "await_callback", **args: Any
) -> tuple[str, Event]:
    """A turn whose one call waits on its waitpoint: (turn id, its tool_waiting)."""
    key = script(
        llm_server,
        Round(tool_calls=calls((tool, {"timeout_s": 30, **args}))),
        Round(text="the callback came"),
    )
    h = client._start_turn(key)
    return h.turn_id, wait_event(client, h.turn_id, "tool_waiting")


def token_of(ev: Event) -> str:
    url = str(ev.fields["callback_url"])
    return parse_qs(urlsplit(url).query)["token"][0]


def tool_message(client: Client, turn_id: str) -> dict[str, Any]:
    history = client.get(turn_id)["history"]
    assert_valid_history(history)
    return next(m for m in history if m["role"] == "tool")


def test_completion_from_the_cli_settles_the_call_once(
    fleet, llm_server, client: Client, agentq_env: dict[str, str]
) -> None:
    turn_id, waiting = waiting_turn(client, llm_server, note="ci run 7")
    f = waiting.fields
    wp_id = str(f["waitpoint_id"])
    assert f["timeout_s"] == 30 and f["tool"] == "await_callback"
    assert f["callback_url"].startswith(f"/v1/waitpoints/{wp_id}?token=")
    # The tool knew its waitpoint before it returned (ctx.waitpoint()).
    assert f["data"]["waitpoint_id"] == wp_id and f["data"]["note"] == "ci run 7"
    assert f["tags"] == ["test"] and f["idempotency_key"].startswith("job-")

    # The call's task ends (just after it published tool_waiting): no tool worker runs
    # anything of this turn while it waits.
    def running_here() -> list[Any]:
        active = client.app.control.inspect(timeout=2.0).active() or {}
        return [t for ts in active.values() for t in ts if turn_id in str(t.get("id"))]

    wait_for(lambda: not running_here(), 20, message="the call's task to end")
    assert client.get(turn_id)["state"]["status"] == "running"

    done = agentq_cli(
        agentq_env, "waitpoint", "complete", wp_id, "--token", token_of(waiting),
        "--json", '{"build": "green", "n": 7}',
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "settled ok" in done.stdout
    events = collect(client, turn_id)
    finished = [e for e in events if e.type == "tool_finished"]
    assert [e.fields["status"] for e in finished] == ["ok"]
    assert events[-1].type == "turn_finished"
    assert json.loads(tool_message(client, turn_id)["content"]) == {"build": "green", "n": 7}

    # A second completion changes nothing and answers with the first.
    with pytest.raises(WaitpointRefused) as second:
        client.complete_waitpoint(wp_id, token_of(waiting), {"build": "red"})
    assert second.value.status_code == 409 and second.value.first is not None
    assert json.loads(second.value.first["content"]) == {"build": "green", "n": 7}
    again = agentq_cli(
        agentq_env, "waitpoint", "complete", wp_id, "--token", token_of(waiting), "--json", "1"
    )
    assert again.returncode == 1 and "completed already" in again.stderr


def test_gateway_endpoint_checks_its_capability_and_body(
    fleet, llm_server, client: Client, http: httpx.Client
) -> None:
    turn_id, waiting = waiting_turn(client, llm_server)
    wp_id, url = str(waiting.fields["waitpoint_id"]), str(waiting.fields["callback_url"])
    # A wrong token, none, or an id nobody made: one answer, 404.
    for bad in (
        f"/v1/waitpoints/{wp_id}?token=x{token_of(waiting)}",
        f"/v1/waitpoints/{wp_id}",
        f"/v1/waitpoints/wp_{'0' * 32}_c1?token={token_of(waiting)}",
        f"/v1/waitpoints/nonsense?token={token_of(waiting)}",
    ):
        r = http.post(bad, json={"x": 1})
        assert r.status_code == 404, (bad, r.text)
        assert r.json()["error"]["type"] == "WaitpointRefused"
    r = http.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    big = "x" * (client.settings.max_result_bytes + 8192)
    assert http.post(url, json={"blob": big}).status_code == 413
    # Still open after every refusal; the good one settles it `error`.
    r = http.post(url, json={"error": "the build failed"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "ok": True,
        "waitpoint_id": wp_id,
        "turn_id": turn_id,
        "call_id": wp_id.split("_", 2)[2],
        "status": "error",
    }
    r = http.post(url, json={"error": "late"})
    assert r.status_code == 409
    assert r.json()["error"]["first"] == {"status": "error", "content": "the build failed"}
    events = collect(client, turn_id)
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["error"]
    assert events[-1].type == "turn_finished"
    assert tool_message(client, turn_id)["content"] == "the build failed"


def test_timeout_settles_timeout_and_a_late_completion_is_gone(
    fleet, llm_server, client: Client, http: httpx.Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("await_callback", {"timeout_s": 1}))),
        Round(text="nobody came"),
    )
    h = client._start_turn(key)
    waiting = wait_event(client, h.turn_id, "tool_waiting")
    events = collect(client, h.turn_id)
    done = next(e for e in events if e.type == "tool_finished")
    assert done.fields["status"] == "timeout"
    assert events[-1].type == "turn_finished"
    content = json.loads(tool_message(client, h.turn_id)["content"])
    assert content["status"] == "timeout" and "nobody completed it" in content["error"]
    r = http.post(str(waiting.fields["callback_url"]), json={"late": True})
    assert r.status_code == 410, r.text
    with pytest.raises(WaitpointRefused) as late:
        client.complete_waitpoint(str(waiting.fields["waitpoint_id"]), token_of(waiting), 1)
    assert late.value.status_code == 410


def test_abort_cancels_the_wait_and_a_later_completion_is_gone(
    fleet, llm_server, client: Client
) -> None:
    turn_id, waiting = waiting_turn(client, llm_server)
    client.abort(turn_id, None, operator=True)
    events = collect(client, turn_id)
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["cancelled"]
    assert events[-1].type == "turn_aborted"
    with pytest.raises(WaitpointRefused) as closed:
        client.complete_waitpoint(str(waiting.fields["waitpoint_id"]), token_of(waiting), "x")
    assert closed.value.status_code == 410 and "cancelled" in closed.value.message


@pytest.mark.parametrize("timeout_s", [0, 10**9])
def test_waitpoint_without_a_finite_allowed_timeout_is_an_error_result(
    fleet, llm_server, client: Client, timeout_s: float
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("await_callback", {"timeout_s": timeout_s}))),
        Round(text="it refused"),
    )
    h = client._start_turn(key)
    events = collect(client, h.turn_id)
    assert "tool_waiting" not in [e.type for e in events]
    done = next(e for e in events if e.type == "tool_finished")
    assert done.fields["status"] == "error"
    assert "AGENTQ_WAITPOINT_MAX_TIMEOUT_S" in str(done.fields["error"])


def test_async_tool_frees_its_slot_and_waits(
    fleet, io_worker, llm_server, client: Client, http: httpx.Client
) -> None:
    turn_id, waiting = waiting_turn(client, llm_server, tool="aio_await_callback")
    r = http.post(str(waiting.fields["callback_url"]), json=["a", "b"])
    assert r.status_code == 200, r.text
    events = collect(client, turn_id)
    assert events[-1].type == "turn_finished"
    assert json.loads(tool_message(client, turn_id)["content"]) == ["a", "b"]


def test_unknown_and_forged_ids_from_the_client(client: Client, agentq_env) -> None:
    for wp_id in ("wp_" + "a" * 32 + "_call1", "not-a-waitpoint"):
        with pytest.raises(WaitpointRefused) as refused:
            client.complete_waitpoint(wp_id, "forged", {})
        assert refused.value.status_code == 404


def test_show_lists_open_waitpoints_and_metrics_count_them(
    fleet, llm_server, client: Client, http: httpx.Client, agentq_env: dict[str, str]
) -> None:
    turn_id, waiting = waiting_turn(client, llm_server)
    shown = agentq_cli(agentq_env, "show", turn_id, "--json")
    assert shown.returncode == 0, shown.stderr
    (open_wp,) = json.loads(shown.stdout)["waitpoints"]
    assert open_wp["id"] == waiting.fields["waitpoint_id"]
    assert open_wp["tool"] == "await_callback" and open_wp["timeout_s"] == 30
    assert 0 <= open_wp["age_s"] < 30 and 0 < open_wp["left_s"] <= 30
    text = agentq_cli(agentq_env, "show", turn_id)
    assert f"waiting: await_callback on {open_wp['id']}" in text.stdout
    # The console's view of the turn lists it too.
    (in_console,) = http.get(f"/v1/turns/{turn_id}/timeline").json()["waitpoints"]
    assert in_console["id"] == open_wp["id"] and in_console["left_s"] <= 30
    client.complete_waitpoint(open_wp["id"], token_of(waiting), "done")
    collect(client, turn_id)
    again = agentq_cli(agentq_env, "show", turn_id, "--json")
    assert json.loads(again.stdout)["waitpoints"] == []

    def scraped() -> str | None:
        body = http.get("/metrics").text
        opened = 'agentq_waitpoints_opened_total{tool="await_callback"}'
        settled = 'agentq_waitpoints_settled_total{status="ok",tool="await_callback"}'
        return body if opened in body and settled in body else None

    assert wait_for(scraped, 30, 0.2, message="waitpoint metrics")


CHOICE = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}}, "required": ["size"]}


def question_turn(
    client: Client, llm_server: Any, *, headless: bool = False, **args: Any
) -> TurnHandle:
    key = script(
        llm_server,
        Round(tool_calls=calls(("ask_user", {"question": "Which size?", **args}))),
        Round(text="noted"),
    )
    return client._start_turn(key, agent="asker", headless=headless)


def test_ask_user_question_checks_its_answer_and_keeps_it_open(
    fleet, llm_server, client: Client, http: httpx.Client
) -> None:
    h = question_turn(client, llm_server, answer_schema=CHOICE)
    turn_id = h.turn_id
    req = wait_event(client, turn_id, "interaction_requested")
    assert req.fields["kind"] == "input" and req.fields["prompt"] == "Which size?"
    assert req.fields["answer_schema"] == CHOICE
    rid = str(req.fields["request_id"])
    with pytest.raises(AnswerInvalid) as bad:
        client.answer(turn_id, rid, h.token, "approve", '{"size": "XL"}')
    assert "size" in bad.value.message
    # Over HTTP too: 422, and the question stays open.
    url = f"/v1/turns/{turn_id}/interactions/{rid}"
    auth = {"Authorization": f"Bearer {h.token}"}
    r = http.post(url, json={"decision": "approve", "value": "plain text"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["type"] == "AnswerInvalid", r.text
    r = http.post(url, json={"decision": "approve", "value": '{"size": "M"}'}, headers=auth)
    assert r.status_code == 200, r.text
    events = collect(client, turn_id)
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["ok"]
    assert events[-1].type == "turn_finished"
    assert json.loads(tool_message(client, turn_id)["content"]) == {"size": "M"}


def test_ask_user_free_text_and_a_declined_question(fleet, llm_server, client: Client) -> None:
    h = question_turn(client, llm_server)
    rid = str(wait_event(client, h.turn_id, "interaction_requested").fields["request_id"])
    client.answer(h.turn_id, rid, h.token, "approve", "medium, please")
    collect(client, h.turn_id)
    assert json.loads(tool_message(client, h.turn_id)["content"]) == "medium, please"
    declined = question_turn(client, llm_server)
    rid = str(wait_event(client, declined.turn_id, "interaction_requested").fields["request_id"])
    client.answer(declined.turn_id, rid, declined.token, "deny")
    events = collect(client, declined.turn_id)
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["denied"]


def test_ask_user_headless_takes_its_default_or_fails_with_exit_4(
    fleet, llm_server, client: Client
) -> None:
    with_default = question_turn(client, llm_server, headless=True, default="M").turn_id
    events = collect(client, with_default)
    assert events[-1].type == "turn_finished"
    assert json.loads(tool_message(client, with_default)["content"]) == "M"
    without = question_turn(client, llm_server, headless=True).turn_id
    ended = collect(client, without)[-1]
    assert ended.type == "turn_error" and ended.fields["exit_code"] == 4


def test_a_wait_outlives_its_tools_hard_limit(fleet, llm_server, client: Client) -> None:
    """The tool's hard limit (1 s here) stops counting once the call waits: the step that
    wakes at its lost-deadline finds the waitpoint and looks again at its deadline."""
    turn_id, waiting = waiting_turn(client, llm_server, _meta={"timeout_s": 1})
    store = client._store
    wp = store.open_waitpoints(turn_id)
    (record,) = wp.values()
    deadline_s = record["deadline_ms"] / 1000

    def next_look() -> float | None:
        return store.redis.zscore(k.shard_key(k.WAKEUPS, turn_id), turn_id)

    # Past the call's hard limit plus grace (1.5 s in the tests' settings), the turn's
    # next look is still the waitpoint's deadline, and the call is not settled lost.
    lost_at = float(record["started_at"]) + 1 + float(client.settings.tool_grace_s)
    wait_for(
        lambda: time.time() > lost_at + 1 and abs((next_look() or 0) - deadline_s) < 0.01,
        30,
        message="the turn to look at the wait's deadline after the hard limit's",
    )
    assert store.result(turn_id, record["id"].split("_", 2)[2]) is None
    client.complete_waitpoint(str(waiting.fields["waitpoint_id"]), token_of(waiting), "late")
    events = collect(client, turn_id)
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["ok"]
    assert tool_message(client, turn_id)["content"] == "late"
