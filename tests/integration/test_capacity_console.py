"""The fleet's model capacity in the gateway: `GET /v1/capacity` (the console's panel) and the
capacity gauges of /metrics, over a real Redis, with real queued rounds, a stream in use,
a pause and an open breaker made through `Capacity` itself."""

from __future__ import annotations

import json
import re
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentq.api import Client
from agentq.config import Settings, load_settings
from agentq.gateway import create_app
from agentq.llm.capacity import Capacity, Grant, Queued
from agentq.llm.headers import RateSignal
from agentq.llm.limits import parse_limits
from agentq.testing.gateway import BackgroundServer

pytestmark = pytest.mark.integration

ALICE_KEY = "alice-" + secrets.token_urlsafe(24)
ADMIN_KEY = "ops-" + secrets.token_urlsafe(24)
METRICS_TOKEN = "scrape-" + secrets.token_urlsafe(24)
API_SECRET = "sk-" + secrets.token_urlsafe(24)
URL_PASSWORD = "pw" + secrets.token_hex(12)
PROVIDER_NAME = "provider-name-" + secrets.token_hex(6)
MODEL = f"cap-{uuid.uuid4().hex[:8]}"
LIMITS = {
    MODEL: {
        "streams": 1,
        "rpm": 600,
        "deployments": [
            {
                "name": "east",
                "streams": 1,
                "api_key": API_SECRET,
                "base_url": f"https://svc:{URL_PASSWORD}@east.invalid/v1",
                "model": PROVIDER_NAME,
            },
            {"name": "west", "rpm": 60, "api_key": API_SECRET + "-west"},
        ],
    }
}
SECRETS = (API_SECRET, URL_PASSWORD, PROVIDER_NAME, "east.invalid")


@dataclass
class Rig:
    keyed: httpx.Client
    open: httpx.Client
    cap: Capacity
    settings: Settings


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def rig(agentq_env: dict[str, str]) -> Iterator[Rig]:
    limits = json.dumps(LIMITS)
    keyed = load_settings(
        llm_limits=limits,
        api_keys=f"alice={ALICE_KEY}",
        admin_keys=f"ops={ADMIN_KEY}",
        metrics_token=METRICS_TOKEN,
    )
    open_ = load_settings(llm_limits=limits)
    client = Client(keyed)
    # The fleet's capacity as any llm worker sees it: the same Redis keys as the gateway's.
    cap = Capacity(client._store.redis, parse_limits(limits), breaker_failures=2)
    with (
        BackgroundServer(create_app(client)) as k_server,
        BackgroundServer(create_app(Client(open_))) as o_server,
        httpx.Client(base_url=k_server.url, timeout=10) as k_http,
        httpx.Client(base_url=o_server.url, timeout=10) as o_http,
    ):
        yield Rig(k_http, o_http, cap, keyed)
    client._store.redis.delete(*cap.keys(MODEL))


@pytest.fixture(scope="module")
def busy_model(rig: Rig) -> Grant:
    """The model with its one stream in use, one interactive and one background round
    waiting, paused fleet-wide for a minute, and the `west` deployment's breaker open."""
    cap = rig.cap

    def ask(waiter: str, interactive: bool) -> Grant | Queued:
        return cap.acquire(MODEL, waiter=waiter, owner="o", interactive=interactive, tokens=10)

    grant = ask("t1:0", True)
    assert isinstance(grant, Grant) and grant.deployment == "east"
    assert isinstance(ask("t2:0", True), Queued)
    assert isinstance(ask("t3:0", False), Queued)
    cap.note_answer(MODEL, "default", RateSignal(pause_s=60.0), status=503)
    for _ in range(2):
        cap.report_failure(MODEL, "west", "5xx")
    return grant


def model_of(body: dict[str, Any], model: str) -> dict[str, Any]:
    return next(m for m in body["models"] if m["model"] == model)


def test_capacity_needs_an_admin_key_when_keys_are_configured(rig: Rig) -> None:
    assert rig.keyed.get("/v1/capacity").status_code == 401
    assert rig.keyed.get("/v1/capacity", headers=auth("not-a-key-" + "0" * 20)).status_code == 401
    r = rig.keyed.get("/v1/capacity", headers=auth(ALICE_KEY))
    assert r.status_code == 403 and r.json()["error"]["type"] == "Forbidden"
    for key in (ADMIN_KEY, METRICS_TOKEN):
        r = rig.keyed.get("/v1/capacity", headers=auth(key))
        assert r.status_code == 200, r.text
        assert r.headers["cache-control"] == "no-store"
    # Without keys the gateway serves this machine only, and shows it to anyone there.
    assert rig.open.get("/v1/capacity").status_code == 200


def test_capacity_shows_queues_streams_pauses_and_breakers(rig: Rig, busy_model: Grant) -> None:
    r = rig.keyed.get("/v1/capacity", headers=auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    body = r.json()
    names = [m["model"] for m in body["models"]]
    assert MODEL in names and rig.settings.llm_model in names
    m = model_of(body, MODEL)
    assert m["configured"] is True
    assert m["queued"] == {"interactive": 1, "background": 1}
    assert m["streams_in_use"] == 1 and isinstance(m["grants_outstanding"], int)
    assert m["paused_until_ms"] > m["now_ms"] and body["now_ms"] >= m["now_ms"]
    assert m["requests_last_minute"] == 1 and m["tokens_last_minute"] == 10
    assert m["limits"] == {"rpm": 600, "tpm": None, "streams": 1, "strategy": "ordered"}
    east, west = m["deployments"]["east"], m["deployments"]["west"]
    assert east["breaker"] == "closed" and east["streams_in_use"] == 1
    assert east["limits"] == {"rpm": None, "tpm": None, "streams": 1}
    assert west["breaker"] == "open" and west["failures"] == 2
    assert west["last_failure"] == "5xx" and west["open_until_ms"] > m["now_ms"]
    assert west["limits"] == {"rpm": 60, "tpm": None, "streams": None}
    # The default model, without configured limits: its state, no limits.
    default = model_of(body, rig.settings.llm_model)
    assert default["limits"] is None and set(default["deployments"]) == {"default"}
    # Names and numbers only: no key, endpoint or provider model name of a deployment.
    for secret in SECRETS:
        assert secret not in r.text, secret
    assert model_of(rig.open.get("/v1/capacity").json(), MODEL)["queued"]["background"] == 1


def test_metrics_gauges_read_the_capacity_at_scrape_time(rig: Rig, busy_model: Grant) -> None:
    assert rig.keyed.get("/metrics", headers=auth(ALICE_KEY)).status_code == 403
    text = rig.keyed.get("/metrics", headers=auth(METRICS_TOKEN)).text

    def gauge(name: str, **labels: str) -> float | None:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    assert gauge("agentq_llm_queued", model=MODEL, **{"class": "interactive"}) == 1
    assert gauge("agentq_llm_queued", model=MODEL, **{"class": "background"}) == 1
    assert gauge("agentq_llm_streams_in_use", model=MODEL) == 1
    assert gauge("agentq_llm_paused", model=MODEL) == 1
    default = rig.settings.llm_model
    assert gauge("agentq_llm_paused", model=default) == 0
    assert gauge("agentq_llm_queued", model=default, **{"class": "interactive"}) is not None
    for secret in SECRETS:
        assert secret not in text, secret

    # The round that held the stream is done: the gauges follow at the next scrape.
    rig.cap.release(busy_model.lease_id, tokens_used=10)
    text = rig.keyed.get("/metrics", headers=auth(METRICS_TOKEN)).text
    assert gauge("agentq_llm_streams_in_use", model=MODEL) == 0
