"""Configuration errors name the setting; the public API list stays honest."""

from __future__ import annotations

import pytest

import agentq
from agentq.config import load_settings
from agentq.errors import AgentqError, ConfigError


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"AGENTQ_TOOL_TIMEOUT_S": "-1"}, "AGENTQ_TOOL_TIMEOUT_S"),
        ({"AGENTQ_MAX_CALLS_PER_TURN": "zero"}, "AGENTQ_MAX_CALLS_PER_TURN"),
        ({"AGENTQ_REDIS_URL": "http://x"}, "AGENTQ_REDIS_URL"),
        ({"AGENTQ_BROKER_URL": "kafka://x"}, "AGENTQ_BROKER_URL"),
        ({"AGENTQ_STREAM_DURATION_S": "0"}, "AGENTQ_STREAM_DURATION_S"),
    ],
)
def test_bad_config_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], setting: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_defaults_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    # Other tests' fixtures may have left AGENTQ_* variables in this process.
    for k in [k for k in os.environ if k.startswith("AGENTQ_")]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    s = load_settings()
    assert s.llm_api_key is not None and s.llm_api_key.get_secret_value() == "sk-test"
    assert s.broker == s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.stream_idle_timeout_ms == 120_000 and s.tool_timeout_s == 120


def test_no_secret_in_the_repr_of_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentq.config import get_settings

    secrets = {
        "AGENTQ_LLM_API_KEY": "sk-llm-secret-0123456789",
        "AGENTQ_FLOWER_BASIC_AUTH": "ops:flower-secret",
        "AGENTQ_API_KEYS": "alice=api-secret",
        "AGENTQ_ADMIN_KEYS": "root=admin-secret",
        "AGENTQ_METRICS_TOKEN": "metrics-secret",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        s = get_settings()
        shown = repr(s) + str(s) + s.model_dump_json()
        for v in secrets.values():
            assert v not in shown, v
        assert (
            s.llm_api_key is not None
            and s.llm_api_key.get_secret_value() == secrets["AGENTQ_LLM_API_KEY"]
        )
    finally:
        get_settings.cache_clear()


def test_public_api_is_exported_and_errors_share_one_root() -> None:
    for name in agentq.__all__:
        assert hasattr(agentq, name), name
    errors = [
        getattr(agentq, n)
        for n in agentq.__all__
        if isinstance(getattr(agentq, n), type) and issubclass(getattr(agentq, n), Exception)
    ]
    assert len(errors) > 15 and all(issubclass(e, AgentqError) for e in errors)
    public = {n for n in dir(agentq) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(agentq.__all__), public - set(agentq.__all__)
