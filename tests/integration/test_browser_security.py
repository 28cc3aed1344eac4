"""The page's key prompt, and a page on another origin failing to drive a local gateway,
in headless Chromium against real gateways, real workers and the scripted model."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from agentq.api import Client
from agentq.config import load_settings
from agentq.gateway import create_app
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import dump_redis, script

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]

KEY = "page-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed_gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    settings = load_settings(api_keys=f"webuser={KEY}")
    with BackgroundServer(create_app(Client(settings))) as server:
        yield server


@pytest.fixture(scope="module")
def open_gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(Client())) as server:
        yield server


def test_the_page_asks_for_a_key_and_keeps_it_out_of_the_url(
    browser: Any,
    keyed_gateway: BackgroundServer,
    llm_server: Any,
    client: Client,
) -> None:
    context = browser.new_context()
    page = context.new_page()
    urls: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(20_000)
    page.goto(keyed_gateway.url + "/")
    # The gateway needs a key: the page says so before anything is sent.
    page.locator("#keyform:not([hidden])").wait_for()
    assert "needs a key" in page.inner_text("#keymsg")
    prompt = script(llm_server, Round(text="Hello, key holder."))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.locator("#apikey").fill("not-the-key-" + secrets.token_urlsafe(8))
    page.click("#usekey")
    page.locator("#keyform:not([hidden])").wait_for()
    assert "not accepted" in page.inner_text("#keymsg")
    assert page.locator("article.turn").count() == 0
    page.locator("#apikey").fill(KEY)
    page.click("#usekey")
    # The prompt waiting for the key is sent with it, and the turn runs to its end.
    page.locator('#status[data-state="finished"]').wait_for()
    assert page.inner_text(".answer") == "Hello, key holder."
    assert page.locator("#keyform").is_hidden()
    turn_id = str(page.locator("article.turn").last.get_attribute("data-turn-id"))
    assert client.get(turn_id)["state"]["owner"] == "webuser"
    assert page.evaluate("sessionStorage.getItem('agentq.key')") == KEY
    # Neither the key nor the turn's token is in the page's address; the key in no URL.
    assert KEY not in page.url and "token" not in page.url
    assert not [u for u in urls if KEY in u]
    assert KEY not in dump_redis(client._store.redis)
    assert not errors, errors
    context.close()


EVIL_PAGE = """<!doctype html><html><body>
<iframe name="sink" style="display:none"></iframe>
<form id="f" method="POST" enctype="text/plain" target="sink" action="{gw}/v1/turns">
  <input name='{{"prompt":"{marker} form","x":"' value='"}}'>
</form>
<script>
const gw = "{gw}";
const body = JSON.stringify({{prompt: "{marker} fetch", detach: true}});
const attempts = [
  fetch(gw + "/v1/turns", {{method: "POST", mode: "no-cors", body,
                           headers: {{"Content-Type": "text/plain"}}}}),
  fetch(gw + "/v1/turns", {{method: "POST", mode: "no-cors", body}}),
  fetch(gw + "/v1/turns", {{method: "POST", body,
                           headers: {{"Content-Type": "application/json"}}}}),
  fetch(gw + "/v1/turns/{victim}/abort", {{method: "POST", mode: "no-cors"}}),
  fetch(gw + "/v1/turns/active").then((r) => r.text()),
];
document.getElementById("f").submit();
Promise.allSettled(attempts).then((results) => {{
  window.outcomes = results.map((r) => r.status + ":" + (r.value && r.value.type ||
    (typeof r.value === "string" ? "read" : r.reason)));
  document.title = "done";
}});
</script></body></html>"""


def test_a_cross_origin_page_cannot_drive_a_local_gateway(
    browser: Any,
    open_gateway: BackgroundServer,
    llm_server: Any,
    client: Client,
) -> None:
    marker = f"evil-{uuid.uuid4().hex[:8]}"
    hang = script(
        llm_server, Round(tool_calls=[ScriptedCall(name="hang", arguments={"seconds": 60})])
    )
    victim = client._start_turn(hang, detach=True)
    html = EVIL_PAGE.format(gw=open_gateway.url, marker=marker, victim=victim.turn_id)

    async def evil(request: Request) -> HTMLResponse:
        return HTMLResponse(html)

    seen: list[tuple[str, str, int]] = []
    with BackgroundServer(Starlette(routes=[Route("/", evil)])) as attacker:
        context = browser.new_context()
        page = context.new_page()
        page.on("response", lambda r: seen.append((r.request.method, r.url, r.status)))
        page.set_default_timeout(20_000)
        page.goto(attacker.url + "/")
        page.wait_for_function("document.title === 'done'")
        outcomes = page.evaluate("window.outcomes")
        # The form's navigation lands in the iframe: wait for its answer too.
        page.wait_for_function(
            "() => { try { return frames[0].location.href !== 'about:blank'; }"
            " catch (e) { return true; } }"
        )
        context.close()
    # no-cors requests resolve opaquely; the CORS ones fail: the page learns nothing.
    assert outcomes[0] == "fulfilled:opaque" and outcomes[1] == "fulfilled:opaque"
    assert outcomes[2].startswith("rejected") and outcomes[4].startswith("rejected")
    posts = [
        status
        for method, url, status in seen
        if method == "POST" and url.startswith(open_gateway.url)
    ]
    assert len(posts) >= 3 and all(s == 403 for s in posts), seen
    # Nothing was started, nothing was aborted.
    assert marker not in dump_redis(client._store.redis)
    assert client._store.status(victim.turn_id) == "running"
    client.abort(victim.turn_id, victim.token)
