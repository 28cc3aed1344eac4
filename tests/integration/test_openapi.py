"""`GET /openapi.json` tells the truth: every real route is in it, every documented
operation exists, and answers callers by the auth rule it documents."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Match, Mount, Route

from agentq.api import Client
from agentq.config import load_settings
from agentq.gateway import create_app
from agentq.testing.gateway import BackgroundServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALICE_KEY = "alice-" + secrets.token_urlsafe(24)
ADMIN_KEY = "ops-" + secrets.token_urlsafe(24)
UNKNOWN_TURN = "0" * 32
PARAMS = {
    "turn_id": UNKNOWN_TURN,
    "request_id": "call_x.approval",
    "path": "app.js",
    "name": "no-such-schedule",
    "conversation_id": "no-such-conversation",
    "waitpoint_id": "wp_" + "0" * 32 + "_call1",
}
BODIES: dict[str, Any] = {
    # Refused by validation, so the check starts no turn.
    "post /v1/turns": {"prompt": ""},
    "post /v1/turns/{turn_id}/interactions/{request_id}": {"decision": "approve"},
    "post /v1/console/turns/{turn_id}/interactions/{request_id}": {"decision": "approve"},
    "post /v1/schedules": {"name": "x", "prompt": "no timing"},
    "post /v1/waitpoints/{waitpoint_id}": {"result": 1},
}


@pytest.fixture(scope="module")
def keyed(agentq_env: dict[str, str]) -> Iterator[tuple[BackgroundServer, Any]]:
    settings = load_settings(api_keys=f"alice={ALICE_KEY}", admin_keys=f"ops={ADMIN_KEY}")
    app = create_app(Client(settings))
    with BackgroundServer(app) as server:
        yield server, app


@pytest.fixture(scope="module")
def doc(keyed: tuple[BackgroundServer, Any]) -> dict[str, Any]:
    server, _ = keyed
    # Public: it describes the API and grants nothing.
    res = httpx.get(server.url + "/openapi.json", timeout=10)
    assert res.status_code == 200 and res.headers["content-type"] == "application/json"
    body: dict[str, Any] = res.json()
    assert body["openapi"].startswith("3.1")
    return body


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m, p, op) for p, ops in doc["paths"].items() for m, op in ops.items()]


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], path)


def test_every_real_route_is_documented_and_every_documented_one_is_real(
    doc: dict[str, Any], keyed: tuple[BackgroundServer, Any]
) -> None:
    _, app = keyed
    documented = {(m.upper(), p) for m, p, _ in operations(doc)}
    for route in app.routes:
        if isinstance(route, Mount):
            assert ("GET", route.path + "/{path}") in documented, route.path
            continue
        assert isinstance(route, Route), route
        for method in route.methods or ():
            if method != "HEAD":
                assert (method, route.path) in documented, (method, route.path)
    for method, path, _ in operations(doc):
        scope = {"type": "http", "method": method.upper(), "path": concrete(path)}
        matches = [r for r in app.routes if r.matches(scope)[0] == Match.FULL]
        assert matches, f"{method.upper()} {path} is documented but no route serves it"


def test_every_reference_resolves(doc: dict[str, Any]) -> None:
    text = json.dumps(doc)
    for ref in set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', text)):
        assert ref in doc["components"]["schemas"], ref
    assert "TurnRequest" in doc["components"]["schemas"]
    assert "InteractionAnswer" in doc["components"]["schemas"]


def call(server: BackgroundServer, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = BODIES.get(f"{method} {path}")
    url = server.url + concrete(path)
    if path.endswith("/events"):
        # A stream: only its status line and headers are needed.
        with httpx.stream(method.upper(), url, headers=headers, timeout=10) as res:
            return res
    return httpx.request(method.upper(), url, headers=headers, json=body, timeout=10)


def test_each_operation_answers_by_its_documented_auth_rule(
    doc: dict[str, Any], keyed: tuple[BackgroundServer, Any]
) -> None:
    server, _ = keyed
    seen: set[str] = set()
    for method, path, op in operations(doc):
        rule = op["x-agentq-auth"]
        seen.add(rule)
        assert op["description"], (method, path)
        anonymous = call(server, method, path, None)
        with_key = call(server, method, path, ALICE_KEY)
        where = f"{method.upper()} {path} ({rule})"
        if rule == "public":
            assert op["security"] == []
            assert anonymous.status_code == 200, (where, anonymous.status_code)
            continue
        if rule == "capability":
            # No key opens it, nor does a key: only the waitpoint's token, here unknown.
            assert op["security"] == []
            assert anonymous.status_code == with_key.status_code == 404, where
            continue
        assert op["security"] == [{"bearer": []}], where
        assert anonymous.status_code == 401, (where, anonymous.status_code)
        if rule == "key":
            assert with_key.status_code in (200, 422), (where, with_key.status_code)
        elif rule in ("turn", "owner", "operator", "conversation"):
            # A turn the key does not own (here: no turn at all) is not found.
            assert with_key.status_code == 404, (where, with_key.status_code)
        elif rule == "admin":
            assert with_key.status_code == 403, (where, with_key.status_code)
            assert call(server, method, path, ADMIN_KEY).status_code == 200, where
        elif rule == "admin_key":
            assert with_key.status_code == 403, (where, with_key.status_code)
            # An unknown schedule (404) or a body without timing (422), as an admin.
            admin = call(server, method, path, ADMIN_KEY).status_code
            assert admin in (200, 404, 422), (where, admin)
        else:
            raise AssertionError(f"undocumented rule {rule!r} at {where}")
    assert seen == {
        "public",
        "key",
        "turn",
        "owner",
        "conversation",
        "operator",
        "admin",
        "admin_key",
        "capability",
    }
