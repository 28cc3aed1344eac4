"""Webhooks without a network: the retry schedule, signatures, which targets are refused."""

from __future__ import annotations

import base64
import os
import socket
from datetime import datetime, timezone
from typing import Any

import pytest
from standardwebhooks import Webhook

from agentq.config import load_settings
from agentq.constants import QUEUE_WEBHOOKS
from agentq.errors import ConfigError, WebhookRefused
from agentq.fleet.roles import role_of
from agentq.webhooks.deliveries import _label
from agentq.webhooks.target import check_url, resolve, signed_headers
from agentq.webhooks.task import JITTER, outcome, retry_delay_s

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


def test_delays_double_up_to_the_cap() -> None:
    assert [retry_delay_s(n, 5, 60) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]
    assert retry_delay_s(10_000, 5, 3600) == 3600
    assert retry_delay_s(1, 10, 60, jitter=0.999) == pytest.approx(10 * (1 - JITTER * 0.999))
    with pytest.raises(ValueError):
        retry_delay_s(0, 5, 60)


def test_outcome_of_an_answer() -> None:
    args: dict[str, Any] = {"created_at": 0.0, "base_s": 5, "max_s": 3600, "max_age_s": 86400}
    assert outcome(204, attempts=3, now=100, **args).status == "delivered"
    assert outcome(410, attempts=1, now=100, **args).status == "gone"
    for code in (None, 301, 400, 429, 500):
        o = outcome(code, attempts=2, now=100, **args)
        assert o.status == "pending" and o.next_at == 110
    # A retry that would fall past 24 h after queueing is not scheduled: the delivery fails.
    late = outcome(500, attempts=30, now=86400 - 100, **args)
    assert late.status == "failed" and late.next_at is None
    assert outcome(500, attempts=30, now=86400 - 3600, **args).status == "pending"


def test_signature_verifies_with_the_reference_implementation() -> None:
    body = b'{"type":"turn.finished","data":{"turn_id":"x"}}'
    headers = signed_headers(SECRET, "msg_1", 1_700_000_000, body)
    wh = Webhook(SECRET)
    # The reference's verify refuses a timestamp this old: compare with its own signature.
    expected = wh.sign("msg_1", datetime.fromtimestamp(1_700_000_000, timezone.utc), body.decode())
    assert headers["webhook-signature"] == expected
    assert headers["webhook-id"] == "msg_1" and headers["webhook-timestamp"] == "1700000000"


@pytest.mark.parametrize(
    ("secret", "why"),
    [("abc", "whsec_"), ("whsec_not base64!", "base64"), ("whsec_" + "QUJD", "24 to 64")],
)
def test_bad_secret_names_the_setting_and_never_shows_it(secret: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        load_settings(webhook_secret=secret)
    assert info.value.setting == "AGENTQ_WEBHOOK_SECRET"
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "https://192.168.1.10/x",
        "https://100.64.0.1/x",
        "https://[fe80::1]/x",
        "https://[::ffff:127.0.0.1]/x",
        "https://0.0.0.0/x",
        "https://api.localhost/x",
        "https://example.com/x#frag",
        "ftp://example.com/x",
        "https:///x",
    ],
)
def test_refused_urls(url: str) -> None:
    with pytest.raises(WebhookRefused):
        check_url(url, allow_http=False, allow_private=False)


def test_allowed_url_keeps_path_query_and_port() -> None:
    t = check_url("https://Hooks.Example.com:8443/a/b?x=1", allow_http=False, allow_private=False)
    assert (t.host, t.port, t.path) == ("hooks.example.com", 8443, "/a/b?x=1")
    assert t.host_header == "hooks.example.com:8443"
    assert t.url_for("93.184.216.34") == "https://93.184.216.34:8443/a/b?x=1"
    assert t.url_for("2001:db8::1") == "https://[2001:db8::1]:8443/a/b?x=1"
    private = check_url("http://127.0.0.1:9/x", allow_http=True, allow_private=True)
    assert private.host_header == "127.0.0.1:9"


def _resolving_to(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    def fake(host: str, port: int, *a: Any, **kw: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a_, port)) for a_ in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_every_resolved_address_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    t = check_url("https://hooks.example.com/x", allow_http=False, allow_private=False)
    _resolving_to(monkeypatch, "93.184.216.34", "10.0.0.5")
    with pytest.raises(WebhookRefused, match=r"resolves to 10\.0\.0\.5, a private address"):
        resolve(t, allow_private=False)
    assert resolve(t, allow_private=True) == ["93.184.216.34", "10.0.0.5"]
    _resolving_to(monkeypatch, "93.184.216.34")
    assert resolve(t, allow_private=False) == ["93.184.216.34"]


def test_the_webhook_queue_belongs_to_the_io_role() -> None:
    assert role_of([QUEUE_WEBHOOKS], [], []) == "io"
    assert role_of(["agentq.io", QUEUE_WEBHOOKS], [], ["agentq.io"]) == "io"
    with pytest.raises(ConfigError, match="of 2"):
        role_of(["agentq.turns", QUEUE_WEBHOOKS], [], [])


def test_attempt_metric_labels_are_the_documented_few() -> None:
    # A 3xx's error says more than its code ("redirects are not followed"); its label does not.
    assert _label("pending", "HTTP 301 (redirects are not followed)") == "http_301"
    assert _label("gone", "HTTP 410") == "http_410"
    assert _label("delivered", None) == "ok"
    assert _label("pending", "timed out after 5s") == "timed_out"
    assert _label("pending", "refused: 10.0.0.1 is a private address") == "refused"
    assert _label("pending", "ConnectError: [Errno 111]") == "unreachable"
