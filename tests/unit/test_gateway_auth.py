"""The pure parts of gateway security: key parsing, the access rule, the request guard."""

from __future__ import annotations

import hashlib

import pytest

from agentq.config import load_settings
from agentq.errors import ConfigError
from agentq.gateway.auth import (
    Keyring,
    Principal,
    check_bind,
    is_loopback,
    may_access,
    may_list,
    parse_keys,
    token_matches,
)
from agentq.gateway.guard import RequestGuard, host_name, is_json
from agentq.gateway.limits import retry_after_header
from agentq.orchestrator.start import hash_token

A = "a" * 20
B = "b" * 20


def test_keys_parse_plain_and_sha256_forms() -> None:
    digest = hashlib.sha256(B.encode()).hexdigest()
    ring = Keyring(parse_keys(f" alice={A} , bob=sha256:{digest.upper()},", setting="X"))
    assert ring.enabled
    assert ring.identify(A) == Principal("alice")
    assert ring.identify(B) == Principal("bob")
    assert ring.identify(digest) is None  # the digest itself is not the key
    assert ring.identify(A + " ") is None and ring.identify("") is None
    assert ring.identify(None) is None
    assert not Keyring([]).enabled


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("alice", "expected name=key"),
        ("=" + A, "expected name=key"),
        ("al ice=" + A, "letters, digits"),
        ("alice=short", "at least 16"),
        ("alice=sha256:abc", "64 hex digits"),
    ],
)
def test_bad_keys_name_the_variable(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"AGENTQ_API_KEYS: .*{message}"):
        Keyring.from_settings(load_settings(api_keys=raw))
    with pytest.raises(ConfigError, match="AGENTQ_ADMIN_KEYS"):
        Keyring.from_settings(load_settings(admin_keys=raw))


def test_a_key_listed_twice_or_a_name_in_both_lists_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        Keyring.from_settings(load_settings(api_keys=f"a={A},b={A}"))
    with pytest.raises(ConfigError, match="both"):
        Keyring.from_settings(load_settings(api_keys=f"a={A}", admin_keys=f"a={B}"))


def test_settings_keep_keys_secret_and_check_cors_origins() -> None:
    s = load_settings(api_keys=f"alice={A}", cors_origins="https://app.example.com")
    assert A not in repr(s) and A not in str(s.model_dump())
    assert s.cors_origins == ["https://app.example.com"]
    for bad in ("*", "app.example.com", "https://app.example.com/path", "ftp://x"):
        with pytest.raises(ConfigError, match="AGENTQ_CORS_ORIGINS"):
            load_settings(cors_origins=bad)
    with pytest.raises(ConfigError, match="AGENTQ_MAX_ACTIVE_TURNS_PER_KEY"):
        load_settings(max_active_turns_per_key=0)
    with pytest.raises(ConfigError, match="AGENTQ_MAX_CONVERSATION_BYTES"):
        load_settings(max_conversation_bytes=10)


def test_access_rule() -> None:
    token = "t" * 43
    state = {"owner": "alice", "token_sha256": hash_token(token)}
    assert token_matches(state, token) and not token_matches(state, token + "x")
    assert not token_matches({"owner": "alice"}, "")
    assert may_access(state, None, token)
    assert may_access(state, Principal("alice"), None)
    assert may_access(state, Principal("root", admin=True), None)
    assert not may_access(state, Principal("bob"), None)
    assert not may_access(state, None, None)
    assert not may_access(state, Principal("bob"), "another turn's token")
    # A turn started without a key belongs to no key, not to a key named "None".
    assert not may_access({"owner": None, "token_sha256": "x"}, Principal("None"), None)
    assert may_list(state, Principal("alice")) and not may_list(state, Principal("bob"))
    assert may_list(state, Principal("ops", admin=True))


def test_loopback_and_bind_rule() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"))
    with pytest.raises(ConfigError, match="AGENTQ_API_KEYS or AGENTQ_ADMIN_KEYS"):
        check_bind("0.0.0.0", Keyring([]), insecure_no_auth=False)


def _scope(method: str, headers: dict[str, str], path: str = "/v1/turns") -> dict[str, object]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "scheme": "http",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }


def test_the_guard() -> None:
    guard = RequestGuard(
        lambda *a: None,
        bind_host="127.0.0.1",  # type: ignore[arg-type]
        cors_origins=["https://app.example.com"],
    )
    json_post = {
        "host": "127.0.0.1:8000",
        "content-type": "application/json",
        "content-length": "10",
    }

    def refused(method: str, **headers: str) -> str | None:
        exc = guard.refusal(_scope(method, headers))  # type: ignore[arg-type]
        return None if exc is None else f"{exc.status_code} {type(exc).__name__}"

    assert refused("POST", **json_post) is None
    assert refused("POST", **json_post, origin="http://127.0.0.1:8000") is None
    assert refused("POST", **json_post, origin="https://app.example.com") is None
    assert refused("POST", **json_post, origin="http://evil.example") == "403 Forbidden"
    assert refused("POST", **json_post, origin="null") == "403 Forbidden"
    assert refused("POST", **json_post, origin="http://127.0.0.1:9999") == "403 Forbidden"
    assert refused("POST", **{**json_post, "sec-fetch-site": "cross-site"}) == "403 Forbidden"
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=1"):
        assert refused("POST", **{**json_post, "content-type": ct}) == "415 UnsupportedMediaType"
    assert refused("POST", host="localhost:8000", **{"content-length": "5"}) == (
        "415 UnsupportedMediaType"
    )
    assert refused("POST", host="localhost:8000") is None  # abort: no body
    assert refused("GET", host="evil.example:8000") == "403 Forbidden"  # DNS rebinding
    assert refused("GET", host="[::1]:8000") is None
    assert guard.refusal(_scope("GET", {"host": "evil"}, "/healthz")) is None  # type: ignore[arg-type]
    anywhere = RequestGuard(
        lambda *a: None,
        bind_host="0.0.0.0",  # type: ignore[arg-type]
        cors_origins=[],
    )
    assert anywhere.refusal(_scope("GET", {"host": "gw.example.com"})) is None  # type: ignore[arg-type]
    assert host_name("[::1]:80") == "::1" and host_name("Example.com:1") == "example.com"
    assert is_json("application/json; charset=utf-8") and is_json("application/merge+json")
    assert not is_json("text/plain")
    assert retry_after_header(0.01) == "1" and retry_after_header(2.2) == "3"


def test_a_redis_cluster_clients_own_error_answers_503_as_any_redis_error() -> None:
    from redis.exceptions import RedisClusterException
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from agentq.gateway.errors import EXCEPTION_HANDLERS

    async def no_node(request: Request) -> None:
        raise RedisClusterException("no node of the cluster answers")

    app = Starlette(routes=[Route("/x", no_node)], exception_handlers=EXCEPTION_HANDLERS)
    res = TestClient(app, raise_server_exceptions=False).get("/x")
    assert res.status_code == 503, res.text
    assert res.json()["error"]["type"] == "RedisUnavailable"
