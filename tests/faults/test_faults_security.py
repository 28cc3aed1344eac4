"""Nobody gets in: a turn's token is needed to abort it or answer it, turn ids (and with
them the event channels) are 128 random bits, passwords are never stored, and Flower is
behind authentication in the compose files."""

from __future__ import annotations

import hmac
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentq import constants as k
from agentq.api import Client
from agentq.cli.main import flower_argv
from agentq.config import load_settings
from agentq.errors import ConfigError, TokenInvalid
from agentq.testing.openai_server import Round
from tests.faults.rig import ROOT
from tests.helpers import assert_valid_history, calls, dump_redis

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(90)]


class _NoBroker:
    """Stands in for the Celery app: the turns are only created, never run."""

    def send_task(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_abort_and_answer_need_the_turns_own_token(rig, monkeypatch) -> None:
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    client = rig.client
    key = rig.script(Round(tool_calls=calls(("delete_file", {"path": "/tmp/x"}))))
    handle = client._start_turn(key)
    other = client._start_turn(rig.script(Round(text="another turn")))
    tid = handle.turn_id
    asked = rig.collect(tid, until=lambda e: e.type == "interaction_requested")[-1]
    rid = asked.fields["request_id"]
    for bad in (None, "", "x", handle.token.upper(), other.token, handle.token + "="):
        with pytest.raises(TokenInvalid):
            client.abort(tid, bad)
        with pytest.raises(TokenInvalid):
            client.answer(tid, rid, bad, "approve")
    # Every non-empty token went through the constant-time comparison, as a hash.
    assert len(compared) >= 8 and all(len(a) == len(b) == 64 for a, b in compared)
    state = client.get(tid)["state"]
    assert state["status"] == "running"
    assert client._store.interaction(tid, rid)[0] == "pending"
    assert client._store.redis.get(k.turn_key(tid, "cancel")) is None

    client.abort(tid, handle.token)
    events = rig.collect(tid)
    assert events[-1].type == "turn_aborted"
    assert_valid_history(client.get(tid)["history"])


def test_turn_ids_are_128_random_bits_and_tokens_are_never_stored(rig) -> None:
    client = Client(app=_NoBroker())
    handles = [client._start_turn(f"id check {i}") for i in range(300)]
    ids = [h.turn_id for h in handles]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in ids)
    assert len(set(ids)) == len(ids)
    # A uuid4 fixes 6 of its bits (version 4, variant 10): 128 random bits vary there too.
    assert {t[12] for t in ids} != {"4"}
    assert {int(t[16], 16) >> 2 for t in ids} != {0b10}
    assert all(k.turn_key(t, "events") == f"agentq:turn:{{{t}}}:events" for t in ids)
    tokens = [h.token for h in handles]
    assert len(set(tokens)) == len(tokens) and min(len(t) for t in tokens) >= 43
    stored = dump_redis(client._store.redis)
    assert not [t for t in tokens[:50] if t in stored]


def test_a_password_answer_is_never_stored_or_logged(rig) -> None:
    secret = f"pw-{uuid.uuid4().hex}"
    client = rig.client
    key = rig.script(Round(tool_calls=calls(("login", {"user": "ada"}))), Round(text="In."))
    handle = client._start_turn(key)
    tid = handle.turn_id
    asked = rig.collect(tid, until=lambda e: e.type == "interaction_requested")[-1]
    assert asked.fields["kind"] == "password"
    client.answer(tid, asked.fields["request_id"], handle.token, "approve", secret)
    events = rig.collect(tid)
    assert events[-1].type == "turn_finished", events[-1]
    turn = client.get(tid)
    assert_valid_history(turn["history"])
    # The tool did get it: it says so, without echoing it.
    assert turn["history"][2]["content"] == "logged in ada"

    redis = client._store.redis
    places = {
        "event log": "\n".join(e.model_dump_json() for e in rig.log_events(tid)),
        "history": str(turn["history"]),
        "turn state hash": str(redis.hgetall(k.turn_key(tid))),
        "interaction hash": str(
            redis.hgetall(k.turn_key(tid, "interaction", asked.fields["request_id"]))
        ),
        "every Redis key": dump_redis(redis),
        "worker logs": rig.logs(),
    }
    leaks = [where for where, text in places.items() if secret in text]
    assert not leaks, leaks
    assert not redis.exists(k.turn_key(tid, "secret", asked.fields["request_id"]))


def test_a_denied_password_is_not_kept_either(rig) -> None:
    secret = f"pw-{uuid.uuid4().hex}"
    client = rig.client
    key = rig.script(Round(tool_calls=calls(("login", {"user": "bob"}))), Round(text="No."))
    handle = client._start_turn(key)
    asked = rig.collect(handle.turn_id, until=lambda e: e.type == "interaction_requested")[-1]
    client.answer(handle.turn_id, asked.fields["request_id"], handle.token, "deny", secret)
    events = rig.collect(handle.turn_id)
    assert events[-1].type == "turn_finished"
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["denied"]
    assert secret not in dump_redis(client._store.redis)


def _compose(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose" / name).read_text())
    return data


def test_flower_requires_basic_auth_in_the_compose_files() -> None:
    flower = _compose("docker-compose.yml")["services"]["flower"]
    env = flower["environment"]
    for var in ("AGENTQ_FLOWER_BASIC_AUTH", "FLOWER_BASIC_AUTH"):
        # ${VAR:?message}: compose refuses to start without it; no default to fall back on.
        assert re.fullmatch(r"\$\{FLOWER_BASIC_AUTH:\?[^}]+\}", env[var]), env[var]
    assert "agentq" in flower["command"] and "flower" in flower["command"]
    # No override file (RabbitMQ, demo) may loosen that.
    overrides = sorted(p.name for p in (ROOT / "compose").glob("docker-compose.*.yml"))
    assert overrides
    for name in overrides:
        flower_over = _compose(name)["services"].get("flower") or {}
        env_over = flower_over.get("environment") or {}
        assert not [key for key in env_over if "AUTH" in key], (name, env_over)
        assert "command" not in flower_over, name
    assert not (Path(ROOT / "compose" / ".env").exists())  # no password committed


def test_agentq_flower_never_listens_beyond_loopback_without_auth(monkeypatch) -> None:
    monkeypatch.delenv("AGENTQ_FLOWER_BASIC_AUTH", raising=False)
    bare = load_settings()
    with pytest.raises(ConfigError, match="AGENTQ_FLOWER_BASIC_AUTH"):
        flower_argv(bare, [], {"FLOWER_ADDRESS": "0.0.0.0"})
    assert "--address=127.0.0.1" in flower_argv(bare, [], {})
    # An empty address is Flower's own default, every address: refused as 0.0.0.0 is.
    for empty in (["--address="], ["--address", ""]):
        with pytest.raises(ConfigError, match="every address"):
            flower_argv(bare, empty, {})
    monkeypatch.setenv("AGENTQ_FLOWER_BASIC_AUTH", "ops:s3cret")
    argv = flower_argv(load_settings(), [], {"FLOWER_ADDRESS": "0.0.0.0"})
    assert "--basic_auth=ops:s3cret" in argv
