"""Webhooks through real workers: a real receiver on 127.0.0.1 checks every signature with
the `standardwebhooks` package; failures, retries with backoff, 410, a worker restart."""

from __future__ import annotations

import base64
import json
import os
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from agentq import constants as k
from agentq.api import Client
from agentq.cli.show import cmd_show
from agentq.config import load_settings
from agentq.errors import ConfigError, WebhookRefused
from agentq.fleet.runtime import get_store
from agentq.gateway import create_app
from agentq.local.fleet import LocalFleet
from agentq.local.processes import ManagedProcess, wait_for
from agentq.models import Usage
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round
from agentq.webhooks.deliveries import Deliveries
from tests.helpers import calls, follow_until, script
from tests.rigs.webhooks import Received, WebhookReceiver, new_secret, webhook_env

pytestmark = pytest.mark.integration

SECRET = new_secret()
ENV = webhook_env(SECRET)


def _webhook_worker(local_fleet: LocalFleet) -> ManagedProcess:
    """A worker for the webhook queue alone, as an operator may run one."""
    return local_fleet.start_worker("io", extra_args=("-Q", k.QUEUE_WEBHOOKS), env=ENV)


class WorkerSlot:
    """The module's webhook worker; a test that kills it puts the next one here."""

    def __init__(self, proc: ManagedProcess) -> None:
        self.proc = proc


@pytest.fixture(scope="module")
def webhook_worker(local_fleet: LocalFleet) -> Iterator[WorkerSlot]:
    slot = WorkerSlot(_webhook_worker(local_fleet))
    yield slot
    slot.proc.stop()


@pytest.fixture()
def hook_client(agentq_env: dict[str, str]) -> Client:
    return Client(
        load_settings(webhook_secret=SECRET, webhook_allow_private=True, webhook_allow_http=True)
    )


def deliveries() -> Deliveries:
    return Deliveries(get_store().redis, load_settings(turn_retention_s=3600))


def verified(r: Received) -> dict[str, Any]:
    """The body, once its signature checks out under the reference implementation."""
    return Webhook(SECRET).verify(r.body, r.headers)  # type: ignore[no-any-return]


def test_finished_turn_posts_one_signed_webhook(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    used = Usage(prompt_tokens=11, completion_tokens=7, total_tokens=18)
    key = script(llm_server, Round(text="The answer is 42.", usage=used))
    with WebhookReceiver([200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        (got,) = rx.wait(1)
        body = verified(got)
        assert got.headers["webhook-id"] == k.webhook_id(handle.turn_id)
        assert body["type"] == "turn.finished"
        data = body["data"]
        assert data["turn_id"] == handle.turn_id and data["status"] == "finished"
        assert data["output_text"] == "The answer is 42."
        assert data["usage"] == {**used.model_dump(exclude={"estimated", "cost_usd"}), "rounds": 1}
        assert data["created_at"] <= data["ended_at"]
        # Anything else must fail the check: the signature covers id, timestamp and body.
        with pytest.raises(WebhookVerificationError):
            Webhook(SECRET).verify(got.body + b" ", got.headers)
        d = wait_for(
            lambda: (
                (x := deliveries().get(k.webhook_id(handle.turn_id)))
                and x.status != "pending"
                and x
            ),
            10,
        )
        assert d.status == "delivered" and d.attempts == 1
        assert [a["status_code"] for a in deliveries().of_turn(d.turn_id)["tries"]] == [200]
        assert SECRET not in json.dumps(hook_client.get(handle.turn_id))
        # Queued: the backstop wakeup the turn's end left is gone.
        wakeups = k.shard_key(k.WAKEUPS, handle.turn_id)
        wait_for(lambda: get_store().redis.zscore(wakeups, handle.turn_id) is None, 5)


def test_a_call_that_starts_waiting_posts_turn_waiting(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("await_callback", {"timeout_s": 60}))),
        Round(text="it came"),
    )
    with WebhookReceiver([200, 200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        (got,) = rx.wait(1)
        body = verified(got)
        assert body["type"] == "turn.waiting"
        data = body["data"]
        assert data["turn_id"] == handle.turn_id and data["tool"] == "await_callback"
        assert got.headers["webhook-id"] == f"{k.webhook_id(handle.turn_id)}_{data['call_id']}"
        token = data["callback_url"].split("token=", 1)[1]
        hook_client.complete_waitpoint(data["waitpoint_id"], token, {"ok": 1})
        ended = verified(rx.wait(2)[1])
        assert ended["type"] == "turn.finished"


def test_a_turn_whose_delivery_was_never_queued_is_found_by_the_sweep(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    """The step that ended the turn died before it queued the delivery: its end left a
    wakeup, and the step that wakes finds the turn ended and queues the delivery."""
    key = script(llm_server, Round(text="ok"))
    with WebhookReceiver([200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        rx.wait(1)
        delivery_id = k.webhook_id(handle.turn_id)
        wait_for(lambda: (d := deliveries().get(delivery_id)) and d.status == "delivered", 10)
        redis = get_store().redis
        # As if the delivery had never been queued: gone, and the end's wakeup still due.
        wakeups = k.shard_key(k.WAKEUPS, handle.turn_id)
        redis.delete(k.webhook_key(delivery_id), k.webhook_key(delivery_id, "attempts"))
        redis.zadd(wakeups, {handle.turn_id: 0})
        again = rx.wait(2)[1]
        assert again.headers["webhook-id"] == delivery_id
        assert verified(again)["data"]["turn_id"] == handle.turn_id
        wait_for(lambda: redis.zscore(wakeups, handle.turn_id) is None, 5)


def test_a_message_injected_into_the_running_turn_posts_its_own_webhook(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    """The injected message's turn is ended by the turn that takes the message; its end keeps
    a wakeup, and the step that wakes queues its delivery."""
    key = script(
        llm_server,
        Round(tool_calls=calls(("sleep", {"seconds": 1.0}))),
        Round(text="saw both"),
    )
    conv = f"hook-{os.urandom(4).hex()}"
    with WebhookReceiver([200]) as rx:
        first = hook_client._start_turn(key, conversation_id=conv, operator=True, detach=True)
        follow_until(hook_client, first.turn_id, "tool_started")
        joined = hook_client._start_turn(
            "also check X",
            conversation_id=conv,
            operator=True,
            multitask="inject",
            webhook_url=rx.url,
            detach=True,
        )
        assert joined.injected is True
        data = verified(rx.wait(1)[0])["data"]
        assert data["turn_id"] == joined.message_turn_id
        assert data["finish_reason"] == "injected"


def test_a_turn_handed_off_for_by_another_still_posts_its_webhook(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    """Its step died between its end and its delivery; the turn queued behind it hands the
    conversation off for it first, and the end's backstop still queues the delivery."""
    from agentq.models import TurnStatus

    key = script(llm_server, Round(tool_calls=calls(("hang", {"seconds": 60}))), Round(text="b"))
    conv = f"hook-{os.urandom(4).hex()}"
    with WebhookReceiver([200]) as rx:
        first = hook_client._start_turn(
            key, conversation_id=conv, operator=True, webhook_url=rx.url, detach=True
        )
        follow_until(hook_client, first.turn_id, "tool_started")
        behind = hook_client._start_turn("next", conversation_id=conv, operator=True, detach=True)
        store = get_store()
        call_id = hook_client.get(first.turn_id)["history"][-1]["tool_calls"][0]["id"]
        answered = {"role": "tool", "tool_call_id": call_id, "content": "cancelled"}
        store.close(
            first.turn_id,
            TurnStatus.ABORTED,
            "turn_aborted",
            {"reason": "user"},
            append=[answered],
            hands_off=True,
        )
        store.wake_by(behind.turn_id, 0)  # its look hands off for the first, before its backstop
        data = verified(rx.wait(1)[0])["data"]
        assert data["turn_id"] == first.turn_id and data["status"] == "aborted"


def test_failures_are_retried_with_backoff_under_one_id(
    fleet, webhook_worker, llm_server, hook_client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    key = script(llm_server, Round(text="ok"))
    with WebhookReceiver([500, 503, 200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        got = rx.wait(3)
        for r in got:
            verified(r)
        assert {r.headers["webhook-id"] for r in got} == {k.webhook_id(handle.turn_id)}
        first_gap, second_gap = got[1].at - got[0].at, got[2].at - got[1].at
        # 0.5 s then 1 s (less up to a fifth of jitter), plus the sweep's tick.
        assert 0.4 <= first_gap < second_gap, (first_gap, second_gap)
        assert second_gap >= 0.8
        d = wait_for(
            lambda: (
                (x := deliveries().get(k.webhook_id(handle.turn_id)))
                and x.status == "delivered"
                and x
            ),
            10,
        )
        tries = deliveries().of_turn(d.turn_id)["tries"]
        assert [a["status_code"] for a in tries] == [500, 503, 200]
        # `agentq show` has the delivery and each attempt.
        assert cmd_show(hook_client, Namespace(turn_id=handle.turn_id, json=True)) == 0
        shown = json.loads(capsys.readouterr().out)["webhook"]
        assert shown["status"] == "delivered" and shown["attempts"] == 3
        assert [t["error"] for t in shown["tries"]] == ["HTTP 500", "HTTP 503", None]
        assert d.id not in {m.decode() for m in get_store().redis.zrange(k.WEBHOOKS_DUE, 0, -1)}


def test_410_stops_the_delivery(fleet, webhook_worker, llm_server, hook_client: Client) -> None:
    key = script(llm_server, Round(text="ok"))
    with WebhookReceiver([410, 200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        d = wait_for(
            lambda: (
                (x := deliveries().get(k.webhook_id(handle.turn_id))) and x.status == "gone" and x
            ),
            15,
        )
        assert d.attempts == 1 and len(rx.received) == 1
        assert get_store().redis.zscore(k.WEBHOOKS_DUE, d.id) is None


def test_aborted_turn_posts_turn_aborted(
    fleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    key = script(llm_server, Round(tool_calls=calls(("sleep", {"seconds": 30}))))
    with WebhookReceiver([200]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url)
        follow_until(hook_client, handle.turn_id, "tool_started")
        hook_client.abort(handle.turn_id, handle.token)
        body = verified(rx.wait(1)[0])
        assert body["type"] == "turn.aborted"
        assert body["data"]["status"] == "aborted" and body["data"]["abort_reason"] == "user"


def test_retries_survive_a_worker_restart(
    fleet, local_fleet: LocalFleet, webhook_worker, llm_server, hook_client: Client
) -> None:
    """The module's worker is killed between two attempts; the retry is due in Redis, and a
    new worker's sweep sends it under the same id."""
    key = script(llm_server, Round(text="ok"))
    with WebhookReceiver([500]) as rx:
        handle = hook_client._start_turn(f"{key} go", webhook_url=rx.url, detach=True)
        rx.wait(1)
        # The first attempt is recorded (due again later) before the worker dies.
        delivery_id = k.webhook_id(handle.turn_id)
        wait_for(lambda: (d := deliveries().get(delivery_id)) and d.attempts >= 1, 10)
        webhook_worker.proc.kill()
        rx.answer([200])
        # A plain `agentq worker io` this time: it consumes the webhook queue by default.
        webhook_worker.proc = local_fleet.start_worker("io", env=ENV)
        d = wait_for(
            lambda: (x := deliveries().get(delivery_id)) and x.status == "delivered" and x,
            30,
        )
        assert d.attempts >= 2
        assert {r.headers["webhook-id"] for r in rx.received} == {delivery_id}
        for r in rx.received:
            verified(r)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://example.com/hook", "scheme must be https"),
        ("https://127.0.0.1/hook", "loopback"),
        ("https://10.1.2.3/hook", "private"),
        ("https://169.254.169.254/latest", "link-local"),
        ("https://[::1]/hook", "loopback"),
        ("https://localhost/hook", "loopback name"),
        ("https://user:pw@example.com/hook", "credentials"),
    ],
)
def test_undeliverable_url_is_refused_at_start(
    agentq_env: dict[str, str], url: str, reason: str
) -> None:
    client = Client(load_settings(webhook_secret=SECRET))
    before = get_store().redis.zcard(k.TURNS_INDEX)
    with pytest.raises(WebhookRefused, match=reason):
        client._start_turn("hi", webhook_url=url)
    assert get_store().redis.zcard(k.TURNS_INDEX) == before


def test_no_secret_no_webhook(agentq_env: dict[str, str]) -> None:
    client = Client(load_settings(webhook_secret=None))
    with pytest.raises(WebhookRefused, match="AGENTQ_WEBHOOK_SECRET"):
        client._start_turn("hi", webhook_url="https://example.com/hook")


ALICE_KEY = "alice-" + base64.b64encode(os.urandom(12)).decode()
ADMIN_KEY = "ops-" + base64.b64encode(os.urandom(12)).decode()


def test_over_http_a_key_default_url_the_console_and_metrics(
    fleet, webhook_worker, llm_server, agentq_env: dict[str, str]
) -> None:
    key = script(llm_server, Round(text="via http"))
    with WebhookReceiver([500, 200]) as rx:
        settings = load_settings(
            webhook_secret=SECRET,
            webhook_allow_private=True,
            webhook_allow_http=True,
            webhook_urls={"alice": rx.url},
            api_keys=f"alice={ALICE_KEY}",
            admin_keys=f"ops={ADMIN_KEY}",
        )
        with (
            BackgroundServer(create_app(Client(settings))) as server,
            httpx.Client(base_url=server.url, timeout=30) as http,
        ):
            alice = {"Authorization": f"Bearer {ALICE_KEY}"}
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            # Private addresses are allowed here; a scheme nobody delivers to is not.
            refused = http.post(
                "/v1/turns", json={"prompt": "x", "webhook_url": "ftp://h/x"}, headers=alice
            )
            assert refused.status_code == 422, refused.text
            assert refused.json()["error"]["type"] == "WebhookRefused"
            assert "scheme must be" in refused.json()["error"]["message"]
            # No webhook_url: alice's key has a default one.
            r = http.post("/v1/turns", json={"prompt": f"{key} go", "detach": True}, headers=alice)
            assert r.status_code == 202, r.text
            turn_id = r.json()["turn_id"]
            got = rx.wait(2)
            assert {verified(g)["data"]["turn_id"] for g in got} == {turn_id}
            wait_for(
                lambda: (d := deliveries().get(k.webhook_id(turn_id))) and d.status == "delivered",
                10,
            )
            view = http.get(f"/v1/turns/{turn_id}/timeline", headers=alice).json()
            assert view["webhook"]["status"] == "delivered"
            assert [t["status_code"] for t in view["webhook"]["tries"]] == [500, 200]
            assert http.get("/v1/webhooks", headers=alice).status_code == 403
            listed = http.get("/v1/webhooks", headers=admin).json()["deliveries"]
            assert k.webhook_id(turn_id) in [d["id"] for d in listed]
            metrics = http.get("/metrics", headers=admin).text
            assert 'agentq_webhook_attempts_total{outcome="http_500"}' in metrics
            assert 'agentq_webhook_deliveries_total{status="delivered"}' in metrics
            assert "agentq_webhook_backlog" in metrics
            assert SECRET not in metrics and SECRET not in json.dumps(view)


def test_a_bad_key_default_url_stops_the_gateway_at_start(agentq_env: dict[str, str]) -> None:
    settings = load_settings(webhook_secret=SECRET, webhook_urls={"alice": "http://x.example/"})
    with pytest.raises(ConfigError, match=r"AGENTQ_WEBHOOK_URLS: alice: .*scheme must be https"):
        create_app(Client(settings))
