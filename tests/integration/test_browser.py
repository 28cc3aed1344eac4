"""The web page in headless Chromium against a real gateway, real workers, the scripted model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from agentq.api import Client
from agentq.gateway import create_app
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import follow_until, script
from tests.integration.chromium import ARTIFACTS

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TERMINAL = ("turn_finished", "turn_aborted", "turn_error")


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client())) as server:
        yield server


@pytest.fixture()
def page(browser: Any, gateway: BackgroundServer) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    pg = context.new_page()
    errors: list[str] = []
    # A 422 is an answer the page shows (a question's refused answer), not a fault of it.
    pg.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" and "of 422" not in m.text else None,
    )
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(20_000)
    pg.goto(gateway.url + "/")
    yield pg
    context.close()
    # A CSP violation or a script error shows up here, not as a failed selector.
    assert not errors, errors


def send(page: Any, prompt: str) -> str:
    before = page.locator("article.turn").count()
    page.fill("#prompt", prompt)
    page.click("#send")
    # The page adds the turn's article once the gateway answered.
    page.locator("article.turn").nth(before).wait_for()
    return str(page.locator("article.turn").nth(before).get_attribute("data-turn-id"))


def test_cancel_from_the_page_aborts_the_running_tool(page, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(
            text="Hanging on.", tool_calls=[ScriptedCall(name="hang", arguments={"seconds": 60})]
        ),
    )
    turn_id = send(page, key)
    chip = page.locator(".chip.running", has_text="hang")
    chip.wait_for()
    elapsed = chip.locator(".elapsed")
    first = elapsed.inner_text()
    # The timer runs in the page: its text changes while the tool is still running.
    page.wait_for_function(
        "(t) => { const e = document.querySelector('.chip.running .elapsed');"
        " return e && e.textContent !== t && parseFloat(e.textContent) > 0.5; }",
        arg=first,
    )
    assert "d-green" in (elapsed.get_attribute("class") or "")
    bands = page.evaluate("[9.9, 10, 29.9, 30.1].map(durationBand)")
    assert bands == ["d-green", "d-yellow", "d-yellow", "d-red"]
    assert page.locator("#cancel").is_enabled()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-running.png"), full_page=True)
    page.click("#cancel")
    page.locator('.chip[data-status="cancelled"]', has_text="hang").wait_for()
    page.locator('#status[data-state="aborted"]').wait_for()
    assert page.inner_text("#status") == "aborted (user)"
    assert page.locator("#send").is_enabled() and page.locator("#cancel").is_disabled()
    assert "Hanging on." in page.inner_text(".answer")
    page.screenshot(path=str(ARTIFACTS / "browser-cancel.png"), full_page=True)
    turn = client.get(turn_id)
    assert turn["state"]["status"] == "aborted"
    assert [r["status"] for r in turn["invocations"]] == ["cancelled"]


def test_the_page_starts_a_turn_as_the_agent_picked(page, llm_server, client: Client) -> None:
    # The picker shows once the page has listed the agents the turn workers run.
    page.locator("#agent-label").wait_for()
    values = page.locator("#agent option").evaluate_all("os => os.map((o) => o.value)")
    assert values[0] == "" and "t_echoer" in values
    page.select_option("#agent", "t_echoer")
    turn_id = send(page, script(llm_server, Round(text="As the echoer.")))
    page.locator('#status[data-state="finished"]').wait_for()
    assert "As the echoer." in page.inner_text(".answer")
    assert client.get(turn_id)["state"]["agent"] == "t_echoer"
    # The choice stays for the conversation's next turn.
    assert page.input_value("#agent") == "t_echoer"


def test_approval_prompt_with_countdown(page, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="delete_file", arguments={"path": "/t"})]),
        Round(text="Deleted it."),
    )
    turn_id = send(page, key)
    ask = page.locator(".ask.pending")
    ask.wait_for()
    assert "delete_file" in ask.locator(".prompt").inner_text()
    countdown = ask.locator(".countdown").inner_text()
    assert countdown.endswith("s left") and 100 < int(countdown.split("s")[0]) <= 120
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-approval-pending.png"), full_page=True)
    ask.locator("button.approve").click()
    page.locator('.chip[data-status="ok"]', has_text="delete_file").wait_for()
    page.locator('#status[data-state="finished"]').wait_for()
    assert page.locator(".ask.approved").count() == 1
    assert page.inner_text(".answer") == "Deleted it."
    page.screenshot(path=str(ARTIFACTS / "browser-approval.png"), full_page=True)
    assert client.get(turn_id)["state"]["status"] == "finished"


def test_password_prompt_hands_the_secret_over(page, llm_server, client: Client) -> None:
    login = ScriptedCall(name="login", arguments={"user": "bob"})
    key = script(llm_server, Round(tool_calls=[login]), Round(text="Logged in."))
    turn_id = send(page, key)
    ask = page.locator(".ask.pending")
    ask.wait_for()
    ask.locator("input.secret[type=password]").fill("hunter2")
    ask.locator("button.approve").click()
    page.locator('.chip[data-status="ok"]', has_text="login").wait_for()
    page.locator('#status[data-state="finished"]').wait_for()
    history = client.get(turn_id)["history"]
    assert [m["content"] for m in history if m["role"] == "tool"] == ["logged in bob"]
    log = [e.model_dump_json() for e in client._store.bus.replay(turn_id)]
    assert not [line for line in [*log, str(history)] if "hunter2" in line]


def test_closing_the_page_aborts_its_attached_turn(page, llm_server, client: Client) -> None:
    key = script(llm_server, Round(tool_calls=[ScriptedCall(name="hang", arguments={})]))
    turn_id = send(page, key)
    page.locator(".chip.running", has_text="hang").wait_for()
    page.close()
    ev = follow_until(client, turn_id, *TERMINAL)
    assert ev.type == "turn_aborted" and ev.fields["reason"] == "disconnect", ev


def test_a_chip_shows_the_progress_its_tool_reports(page, llm_server, client: Client) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 3})]),
        Round(text="Slept."),
    )
    turn_id = send(page, key)
    chip = page.locator(".chip.running", has_text="sleep")
    chip.wait_for()
    # ctx.progress("sleeping", pct=...) every half second: message and percent in the chip.
    page.wait_for_function(
        "() => { const p = document.querySelector('.chip.running .progress');"
        " return p && /^sleeping \\d+%$/.test(p.textContent) && parseInt(p.textContent"
        ".split(' ')[1]) > 0; }"
    )
    page.locator('.chip[data-status="ok"]', has_text="sleep").wait_for()
    assert page.locator('.chip[data-status="ok"] .progress').inner_text() == ""
    assert follow_until(client, turn_id, *TERMINAL).type == "turn_finished"


def test_a_sub_agent_works_nested_under_its_call_and_asks_from_the_page(
    page, llm_server, client: Client
) -> None:
    child_key = script(
        llm_server,
        Round(
            text="Child deleting.",
            tool_calls=[ScriptedCall(name="delete_file", arguments={"path": "/sub"})],
        ),
        Round(text="child done"),
    )
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="ask_asker", arguments={"prompt": f"{child_key} go"})]),
        Round(text="Lead is done."),
    )
    page.locator("#agent-label").wait_for()
    page.select_option("#agent", "t_boss")
    turn_id = send(page, key)
    # The child's request is relayed into the parent's stream and shown, named by its call.
    ask = page.locator(".ask.pending")
    ask.wait_for()
    assert ask.locator(".who").inner_text() == "ask_asker"
    assert "delete_file" in ask.locator(".prompt").inner_text()
    # The child's text shows nested under the agent call's chip (its tool gets a chip
    # when it starts, after the approval, as a turn's own tools do).
    sub = page.locator(".subagent")
    sub.locator(".sub-text", has_text="Child deleting.").wait_for()
    assert sub.locator(".chip", has_text="delete_file").count() == 0
    assert page.locator(".tools > .chip", has_text="ask_asker").count() == 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-subagent-ask.png"), full_page=True)
    ask.locator("button.approve").click()
    sub.locator('.chip[data-status="ok"]', has_text="delete_file").wait_for()
    page.locator('.chip[data-status="ok"]', has_text="ask_asker").wait_for()
    page.locator('#status[data-state="finished"]').wait_for()
    assert page.inner_text("article.turn .answer") == "Lead is done."
    assert sub.get_attribute("data-state") == "finished"
    page.screenshot(path=str(ARTIFACTS / "browser-subagent.png"), full_page=True)
    child = client.get(turn_id)["invocations"][0]["task_id"]
    assert client.get(child)["state"]["parent_turn_id"] == turn_id


def test_a_second_message_while_a_turn_runs_is_queued_or_joins_it(
    page, llm_server, client: Client
) -> None:
    nap = Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 1.5})])
    key = script(
        llm_server,
        nap,
        Round(text="Saw the addition."),
        nap,
        Round(text="slow done"),
        Round(text="And the queued one."),
    )
    first = send(page, key)
    page.locator(".chip.running", has_text="sleep").wait_for()
    # Send stays enabled while a turn runs; the message joins the running turn.
    page.select_option("#multitask", "inject")
    joined = send(page, "also this")
    assert joined != first
    page.locator(f'article[data-turn-id="{joined}"].injected').wait_for()
    running = page.locator(f'article[data-turn-id="{first}"]')
    running.locator(".injected-note").wait_for()
    page.locator(f'article[data-turn-id="{first}"] .outcome[data-state="finished"]').wait_for()
    assert "Saw the addition." in running.locator(".answer").inner_text()
    # A slow turn, then a message queued behind it.
    busy = send(page, "slow please")
    page.locator(f'article[data-turn-id="{busy}"] .chip.running', has_text="sleep").wait_for()
    page.select_option("#multitask", "enqueue")
    queued = send(page, "after that")
    page.locator(f'article[data-turn-id="{queued}"] .queued-note').wait_for()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser-queued.png"), full_page=True)
    page.locator(f'article[data-turn-id="{queued}"] .outcome[data-state="finished"]').wait_for()
    page.locator('#status[data-state="finished"]').wait_for()
    assert client.get(joined)["state"]["injected_into"] == first
    history = client.get(queued)["history"]
    users = [m["content"] for m in history if m["role"] == "user"]
    assert users == [key, "also this", "slow please", "after that"]


def test_a_question_for_the_user_is_a_form_checked_against_its_schema(
    page, llm_server, client: Client
) -> None:
    qty = {
        "type": "object",
        "properties": {"qty": {"type": "integer", "minimum": 1}, "size": {"enum": ["S", "M"]}},
        "required": ["qty", "size"],
    }
    question = {"question": "How many?", "answer_schema": qty}
    ask_call = ScriptedCall(name="ask_user", arguments=question)
    key = script(llm_server, Round(tool_calls=[ask_call]), Round(text="Ordered."))
    page.locator("#agent-label").wait_for()
    page.select_option("#agent", "asker")
    turn_id = send(page, key)
    ask = page.locator(".ask.pending")
    ask.wait_for()
    assert ask.locator(".prompt").inner_text() == "How many?"
    ask.locator(".answer-form input").fill("0")
    ask.locator(".answer-form select").select_option("M")
    ask.locator("button.approve").click()
    # Refused (422): the question stays open and says why.
    page.locator(".ask.pending .answer-error", has_text="qty").wait_for()
    ask.locator(".answer-form input").fill("2")
    ask.locator("button.approve").click()
    page.locator('#status[data-state="finished"]').wait_for()
    history = client.get(turn_id)["history"]
    tool = [m["content"] for m in history if m["role"] == "tool"]
    assert [json.loads(c) for c in tool] == [{"qty": 2, "size": "M"}]


def test_a_waiting_call_is_completed_from_its_chip(page, llm_server, client: Client) -> None:
    wait = ScriptedCall(name="await_callback", arguments={"timeout_s": 60})
    key = script(llm_server, Round(tool_calls=[wait]), Round(text="It came."))
    turn_id = send(page, key)
    chip = page.locator(".chip", has_text="await_callback")
    chip.locator(".progress", has_text="waiting on wp_").wait_for()
    page.once("dialog", lambda d: d.accept('{"build": "green"}'))
    chip.locator("button.complete").click()
    page.locator('.chip[data-status="ok"]', has_text="await_callback").wait_for()
    page.locator('#status[data-state="finished"]').wait_for()
    history = client.get(turn_id)["history"]
    assert [m["content"] for m in history if m["role"] == "tool"] == ['{"build": "green"}']
