"""Spend's pure decisions, without Redis or waiting: prices, period resets, and the
settings that configure them. (The reservation's completion cap and a key's refusal of a
start are decided by RESERVE alone: tests/integration/test_spend_scripts.py.)"""

from __future__ import annotations

import datetime as dt
import json

import pytest

from agentq.config import ModelPrice, load_settings
from agentq.errors import ConfigError
from agentq.state.budget import cost_usd, day_of, lower_limit, resets_at

PRICE = ModelPrice(input=2.0, output=8.0, cached_input=0.5)


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.timezone.utc).timestamp()


def test_cost_prices_input_cached_and_output_per_million() -> None:
    assert cost_usd(PRICE, 1000, 100, 400) == pytest.approx((600 * 2 + 400 * 0.5 + 100 * 8) / 1e6)
    # Without a cached price, cached tokens cost the input price.
    plain = ModelPrice(input=2.0, output=8.0)
    assert cost_usd(plain, 1000, 0, 400) == pytest.approx(1000 * 2 / 1e6)
    assert cost_usd(None, 1000, 100) is None
    # More cached tokens than prompt tokens (a server's mistake) are not a discount.
    assert cost_usd(PRICE, 10, 0, 50) == pytest.approx(10 * 0.5 / 1e6)


def test_periods_reset_at_utc_midnight_and_the_first_of_the_month() -> None:
    now = ts(2026, 12, 31, 23, 59)
    assert day_of(now) == "20261231"
    assert resets_at("tokens_per_day", day_of(now)) == ts(2027, 1, 1)
    assert resets_at("usd_per_day", "20260203") == ts(2026, 2, 4)
    assert resets_at("usd_per_month", day_of(now)) == ts(2027, 1, 1)
    assert resets_at("usd_per_month", "20260203") == ts(2026, 3, 1)


def test_a_request_may_lower_its_agents_limit_not_raise_it() -> None:
    assert lower_limit(None, 100) == 100
    assert lower_limit(50, 100) == 50
    assert lower_limit(500, 100) == 100
    assert lower_limit(500, None) == 500


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "not valid JSON"),
        ('{"m": {"input": -1, "output": 1}}', "m.input"),
        ('{"m": {"input": "cheap", "output": 1}}', "m.input"),
        ('{"m": {"input": 1}}', "m.output"),
        ('["m"]', "JSON object"),
    ],
)
def test_bad_prices_fail_naming_the_setting(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match="AGENTQ_LLM_PRICES") as err:
        load_settings(llm_prices=value)
    assert says in str(err.value)


def test_bad_key_budgets_fail_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"AGENTQ_KEY_BUDGETS.*ci\.usd_per_day"):
        load_settings(key_budgets=json.dumps({"ci": {"usd_per_day": -2}}))
    with pytest.raises(ConfigError, match="AGENTQ_KEY_BUDGETS"):
        load_settings(key_budgets=json.dumps({"ci": {"dollars": 2}}))


def test_prices_and_budgets_load_from_json() -> None:
    s = load_settings(
        llm_prices=json.dumps({"m": {"input": 1, "output": 2}}),
        key_budgets=json.dumps({"ci": {"tokens_per_day": 10}}),
    )
    assert s.llm_prices.get("m") == ModelPrice(input=1, output=2)
    assert s.llm_prices.get("other") is None
    assert s.key_budgets["ci"].tokens_per_day == 10


def test_a_price_change_between_rounds_prices_the_next_round_anew() -> None:
    from types import SimpleNamespace

    from agentq.models import AssistantMessage, LlmRoundResult, Usage
    from agentq.orchestrator.spend import round_usage

    used = Usage(prompt_tokens=1000, completion_tokens=100, total_tokens=1100)
    result = LlmRoundResult(ok=True, message=AssistantMessage(content="x", usage=used))
    costs = []
    for price in ({"input": 1, "output": 2}, {"input": 3, "output": 6}):
        settings = load_settings(llm_prices=json.dumps({"m": price}), budget_completion_tokens=64)
        ctx = SimpleNamespace(settings=settings, state={})
        costs.append(round_usage(ctx, result, "m").cost_usd)  # type: ignore[arg-type]
    assert costs == [pytest.approx(1200 / 1e6), pytest.approx(3600 / 1e6)]
    # A round with no usage (a broken stream) is charged its reservation, estimated.
    broken = LlmRoundResult(ok=False, error="dropped")
    ctx = SimpleNamespace(settings=settings, state={"budget_prompt": 500, "budget_cap": 40})
    charged = round_usage(ctx, broken, "m")  # type: ignore[arg-type]
    assert (charged.prompt_tokens, charged.completion_tokens, charged.estimated) == (500, 40, True)
    assert charged.cost_usd == pytest.approx((500 * 3 + 40 * 6) / 1e6)
