"""A turn ended by its budget, as its reporters tell it: the webhook (a real receiver on
127.0.0.1, signatures checked with `standardwebhooks`) and `agentq run`'s exit code and
last line, through the session's real workers."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from standardwebhooks import Webhook

from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess, run_process
from agentq.models import Usage
from agentq.testing.openai_server import Round
from tests.helpers import calls, script
from tests.rigs.webhooks import WebhookReceiver, new_secret, webhook_env

pytestmark = pytest.mark.integration

SECRET = new_secret()
BUDGET = 2500
"""A turn's max_tokens: its first round (the prompt's estimate is about 1,900 tokens, the
tools' schemas included) fits; after it, reported at 1,050 tokens, no second one does."""


def spending_rounds(llm_server: object) -> str:
    used = Usage(prompt_tokens=1000, completion_tokens=50)
    loop = [Round(tool_calls=calls(("echo", {"text": f"r{i}"})), usage=used) for i in range(5)]
    return script(llm_server, *loop, Round(text="done", usage=used))


@pytest.fixture(scope="module")
def webhook_worker(local_fleet: LocalFleet) -> Iterator[ManagedProcess]:
    proc = local_fleet.start_worker(
        "io", extra_args=("-Q", k.QUEUE_WEBHOOKS), env=webhook_env(SECRET)
    )
    yield proc
    proc.stop()


def test_a_webhook_reports_a_turn_ended_by_its_budget(
    fleet, webhook_worker, llm_server, agentq_env: dict[str, str]
) -> None:
    client = Client(
        load_settings(webhook_secret=SECRET, webhook_allow_private=True, webhook_allow_http=True)
    )
    key = spending_rounds(llm_server)
    with WebhookReceiver([200]) as rx:
        handle = client._start_turn(f"{key} go", webhook_url=rx.url, detach=True, max_tokens=BUDGET)
        (got,) = rx.wait(1)
    body = Webhook(SECRET).verify(got.body, got.headers)
    assert body["type"] == "turn.failed"
    data = body["data"]
    assert data["turn_id"] == handle.turn_id and data["status"] == "error"
    assert data["error_code"] == "budget_exceeded"
    assert "max_tokens" in data["error"] and str(BUDGET) in data["error"]
    # What the turn spent comes with it: the one round it could afford.
    assert data["usage"]["prompt_tokens"] == 1000 and data["usage"]["completion_tokens"] == 50


def test_agentq_run_exits_1_with_a_line_naming_the_budget(
    fleet, llm_server, agentq_env: dict[str, str]
) -> None:
    key = spending_rounds(llm_server)
    ran = run_process(
        [sys.executable, "-m", "agentq", "run", "--max-tokens", str(BUDGET), f"{key} go"],
        timeout_s=120,
    )
    assert ran.returncode == 1, (ran.stdout, ran.stderr)
    out = " ".join((ran.stdout + ran.stderr).split())
    assert "turn failed" in out
    assert f"the turn's budget max_tokens is spent: 1050 of {BUDGET}" in out
