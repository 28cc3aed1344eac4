"""AGENTQ_LLM_LIMITS parsing, provider rate-limit headers and token estimates: pure."""

from __future__ import annotations

import email.utils

import pytest

from agentq.errors import ConfigError
from agentq.llm.capacity import Capacity, pacing_interval_ms
from agentq.llm.headers import RateSignal, parse_duration_s, parse_rate_headers, rate_headers
from agentq.llm.limits import DEFAULT_COMPLETION_TOKENS, estimate_tokens, parse_limits


def test_the_documented_example_parses() -> None:
    limits = parse_limits('{"gpt-4.1": {"rpm": 500, "tpm": 300000, "streams": 200}}')
    entry = limits["gpt-4.1"]
    assert (entry.rpm, entry.tpm, entry.streams) == (500, 300000, 200)
    assert entry.strategy == "ordered"
    # No deployments: one implicit deployment, the configured base URL.
    assert [d.name for d in entry.routes] == ["default"]
    default = entry.deployment("default")
    assert default is not None and default.base_url is None


def test_unset_or_blank_means_no_limits() -> None:
    assert parse_limits(None) == {}
    assert parse_limits("  ") == {}


def test_deployments_keep_their_order_and_hide_their_keys() -> None:
    raw = """{"gpt-4.1": {"rpm": 900, "strategy": "least_loaded", "deployments": [
        {"name": "east", "base_url": "https://east.example/v1", "model": "gpt-41-east",
         "api_key": "sk-east-secret", "rpm": 600, "streams": 50},
        {"name": "west", "base_url": "https://west.example/v1", "rpm": 300}]}}"""
    entry = parse_limits(raw)["gpt-4.1"]
    assert entry.strategy == "least_loaded"
    assert [d.name for d in entry.routes] == ["east", "west"]
    east = entry.deployment("east")
    assert east is not None and east.model == "gpt-41-east" and east.streams == 50
    assert east.api_key is not None and east.api_key.get_secret_value() == "sk-east-secret"
    assert "sk-east-secret" not in repr(entry) and "sk-east-secret" not in str(entry)
    assert "sk-east-secret" not in entry.model_dump_json()
    assert entry.deployment("north") is None


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object keyed by model name"),
        ('{"m": 5}', "m: must be an object"),
        ('{"m": {"rpm": 0}}', "m: rpm: Input should be greater than 0"),
        ('{"m": {"rpm": "500"}}', "m: rpm: Input should be a valid integer"),
        ('{"m": {"rpm": true}}', "m: rpm: Input should be a valid integer"),
        ('{"m": {"rmp": 5}}', "m: rmp: Extra inputs are not permitted"),
        ('{"m": {}}', "sets none of rpm, tpm, streams, deployments"),
        ('{"m": {"rpm": 5, "strategy": "random"}}', "strategy"),
        ('{"a{b}": {"rpm": 5}}', "bad model name"),
        ('{"m": {"deployments": [{"name": "a"}, {"name": "a"}]}}', "repeated: a"),
        ('{"m": {"deployments": [{"name": "a b"}]}}', "deployments.0.name"),
        ('{"m": {"deployments": [{"name": "a", "tpm": -1}]}}', "deployments.0.tpm"),
        # The implicit deployment's name: its endpoint, key and model would be ignored.
        (
            '{"m": {"deployments": [{"name": "default", "base_url": "http://x/v1"}]}}',
            "'default' names the implicit deployment",
        ),
    ],
)
def test_bad_config_names_the_setting_and_the_problem(raw: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_limits(raw)
    assert info.value.setting == "AGENTQ_LLM_LIMITS"
    assert str(info.value).startswith("AGENTQ_LLM_LIMITS: ")
    assert needle in str(info.value)


def test_a_bad_api_key_is_not_echoed_in_the_error() -> None:
    raw = '{"m": {"deployments": [{"name": "a", "api_key": "sk-secret", "rpm": 0}]}}'
    with pytest.raises(ConfigError) as info:
        parse_limits(raw)
    assert "sk-secret" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("250ms", 0.25),
        ("6m0s", 360.0),
        ("1h2m3.5s", 3723.5),
        ("0.5s", 0.5),
        ("20", 20.0),
        ("1.5", 1.5),
        ("100us", 1e-4),
    ],
)
def test_openai_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "5 s", "1x", "s", "nan", "inf", "1s2"])
def test_unreadable_durations_are_none(text: str) -> None:
    assert parse_duration_s(text) is None


def test_openai_headers() -> None:
    signal = parse_rate_headers(
        {
            "X-RateLimit-Limit-Requests": "500",
            "x-ratelimit-limit-tokens": "300000",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-remaining-tokens": "149984",
            "x-ratelimit-reset-requests": "6m0s",
            "x-ratelimit-reset-tokens": "250ms",
        }
    )
    assert signal == RateSignal(
        pause_s=None,
        remaining_requests=0,
        remaining_tokens=149984,
        reset_requests_s=360.0,
        reset_tokens_s=0.25,
        limit_requests=500,
        limit_tokens=300000,
    )


def test_retry_after_in_its_three_forms() -> None:
    assert parse_rate_headers({"retry-after": "7"}).pause_s == 7.0
    assert parse_rate_headers({"Retry-After-Ms": "1500", "retry-after": "9"}).pause_s == 1.5
    now_s = 1_700_000_000.0
    date = email.utils.formatdate(now_s + 30, usegmt=True)
    assert parse_rate_headers({"retry-after": date}, now_s=now_s).pause_s == pytest.approx(30.0)
    past = email.utils.formatdate(now_s - 30, usegmt=True)
    assert parse_rate_headers({"retry-after": past}, now_s=now_s).pause_s == 0.0
    assert parse_rate_headers({"retry-after": "whenever"}).pause_s is None
    assert parse_rate_headers({}) == RateSignal()


def test_anthropic_headers_with_rfc3339_resets() -> None:
    now_s = 1_700_000_000.0  # 2023-11-14T22:13:20Z
    # Through rate_headers, as every answer's headers reach capacity.
    kept = rate_headers(
        {
            "Content-Type": "text/event-stream",
            "Anthropic-Ratelimit-Requests-Limit": "50",
            "anthropic-ratelimit-requests-remaining": "3",
            "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:32Z",
            "anthropic-ratelimit-tokens-remaining": "0",
            "anthropic-ratelimit-tokens-reset": "2023-11-14T22:14:20+00:00",
        }
    )
    assert "content-type" not in kept
    signal = parse_rate_headers(kept, now_s=now_s)
    assert signal.limit_requests == 50 and signal.remaining_requests == 3
    assert signal.reset_requests_s == pytest.approx(12.0)
    assert signal.remaining_tokens == 0 and signal.reset_tokens_s == pytest.approx(60.0)


def test_garbage_counts_are_none() -> None:
    signal = parse_rate_headers({"x-ratelimit-remaining-requests": "lots"})
    assert signal.remaining_requests is None


def test_the_signal_is_frozen() -> None:
    with pytest.raises(ValueError):
        RateSignal().pause_s = 3  # type: ignore[misc]


def test_estimate_is_the_prompt_plus_the_completion_allowance() -> None:
    assert estimate_tokens(1000, 500) == 1500
    assert estimate_tokens(1001, None) == 1001 + DEFAULT_COMPLETION_TOKENS
    assert estimate_tokens(0, 0) == 1  # a request counts at least one token
    assert estimate_tokens(-5, -5) == 1


def test_pacing_interval_is_the_binding_limit() -> None:
    entry = parse_limits('{"m": {"rpm": 600, "tpm": 60000}}')["m"]
    assert pacing_interval_ms(entry, 10) == pytest.approx(100.0)  # rpm binds: 10/s
    assert pacing_interval_ms(entry, 5000) == pytest.approx(5000.0)  # tpm binds
    split = parse_limits(
        '{"m": {"deployments": [{"name": "a", "rpm": 60}, {"name": "b", "rpm": 120}]}}'
    )["m"]
    assert pacing_interval_ms(split, 1) == pytest.approx(60_000 / 180)
    streams_only = parse_limits('{"m": {"streams": 3}}')["m"]
    assert pacing_interval_ms(streams_only, 1000) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lease_ttl_ms": 0}, "ttls"),
        ({"waiter_ttl_ms": -1}, "ttls"),
        ({"owner_weights": {"a": 0.0}}, "weights"),
        ({"breaker_failures": 0}, "breaker_failures"),
    ],
)
def test_a_capacity_built_directly_refuses_values_out_of_range(
    kwargs: dict[str, object], match: str
) -> None:
    import redis

    with pytest.raises(ValueError, match=match):
        Capacity(redis.Redis(), {}, **kwargs)  # type: ignore[arg-type]
