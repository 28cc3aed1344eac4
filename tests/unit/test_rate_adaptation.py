"""The rate adaptation alone: the pure Lua functions every capacity script evaluates (the
cut on a 429, the climb back, the learned ceiling, the slow start and the probe), run
under Lua 5.1 as Redis has it, with no Redis and no script around them."""

from __future__ import annotations

from typing import Any

import lupa.lua51 as lua51  # fakeredis[lua], a dev extra, brings it
import pytest

from agentq.llm.capacity_rate import (
    DECREASE,
    PROBE,
    RATE_LUA,
    RECOVER_S,
    SLOW_START,
    TOP_SHARE,
)

T = 1_700_000_000_000
"""The cut's time, in epoch ms."""


@pytest.fixture(scope="module")
def lua() -> Any:
    return lua51.LuaRuntime()


@pytest.fixture(scope="module")
def rate(lua: Any) -> Any:
    return lua.execute(
        RATE_LUA + "return {ceiling_of = ceiling_of, admitted_rpm = admitted_rpm, cut = cut}"
    )


@pytest.fixture(scope="module")
def table(lua: Any) -> Any:
    """A rate hash as the scripts read it, made a Lua table."""
    return lua.table_from


def test_without_a_cut_the_admitted_rate_is_the_ceiling(rate: Any, table: Any) -> None:
    nothing = table({"t": 0, "ai": 0, "top": 0, "lr": 0})
    assert rate.admitted_rpm(nothing, 1200, T) == 1200
    assert rate.admitted_rpm(nothing, 0, T) == 0  # nothing known: unpaced


def test_the_configured_rpm_is_the_ceiling_else_the_providers_own_limit(
    rate: Any, table: Any
) -> None:
    learned = table({"lr": 600})
    assert rate.ceiling_of(1200, learned) == 1200
    assert rate.ceiling_of(0, learned) == 600
    assert rate.ceiling_of(0, table({"lr": 0})) == 0


def test_a_429_cuts_the_admitted_rate_and_it_climbs_back_to_the_ceiling(
    rate: Any, table: Any
) -> None:
    r, ai, top = rate.cut(1200, 1200, 0)
    assert r == pytest.approx(1200 * DECREASE)
    assert top == 1200
    cut = table({"r": r, "t": T, "ai": ai, "top": top, "lr": 0})
    assert rate.admitted_rpm(cut, 1200, T) == pytest.approx(960)
    half = T + int(RECOVER_S * 500)
    assert rate.admitted_rpm(cut, 1200, half) == pytest.approx(1080)
    assert rate.admitted_rpm(cut, 1200, T + int(RECOVER_S * 1000)) == pytest.approx(1200)
    assert rate.admitted_rpm(cut, 1200, T + 60_000) == 1200  # never past the ceiling
    assert rate.admitted_rpm(cut, 1200, T - 5_000) == pytest.approx(960)  # no clock goes back


def test_a_second_429_cuts_from_where_the_climb_had_got(rate: Any, table: Any) -> None:
    r1, ai1, top1 = rate.cut(1200, 1200, 0)
    mid = rate.admitted_rpm(table({"r": r1, "t": T, "ai": ai1, "top": top1}), 1200, T + 2000)
    r2, _, top2 = rate.cut(mid, 1200, 0)
    assert r2 == pytest.approx(mid * DECREASE) and r2 < r1
    assert top2 == 1200


def test_without_a_ceiling_the_climb_ends_under_the_rate_refused_then_probes_past_it(
    rate: Any, table: Any
) -> None:
    r, ai, top = rate.cut(900, 0, 0)
    assert (r, top) == (pytest.approx(900 * DECREASE), pytest.approx(900 * TOP_SHARE))
    cut = table({"r": r, "t": T, "ai": ai, "top": top})
    back = T + round((top - r) / ai * 1000)  # about 2 s: a climb of a tenth of the rate
    assert rate.admitted_rpm(cut, 0, back) == pytest.approx(top, rel=1e-4)
    assert rate.admitted_rpm(cut, 0, back + 1000) == pytest.approx(top * (1 + PROBE), rel=1e-4)
    assert rate.admitted_rpm(cut, 0, back + 10_000) == pytest.approx(
        top * (1 + 10 * PROBE), rel=1e-4
    )


def test_without_a_ceiling_each_429_brings_the_climbs_end_down_to_the_providers_limit(
    rate: Any,
) -> None:
    # Slow start overshot to 34 a second against a provider of 20: each 429 at the climb's
    # end lowers it, until the climb ends under the limit and only the probe reaches it.
    limit_rpm, rpm, tops = 1200, 34 * 60, []
    for _ in range(10):
        if rpm <= limit_rpm:
            break
        _, _, top = rate.cut(rpm, 0, 0)
        tops.append(top)
        rpm = top  # refused again where the climb ends, before the probe
    assert tops[-1] <= limit_rpm and len(tops) <= 6
    assert tops == sorted(tops, reverse=True)


def test_with_nothing_known_the_first_429_guesses_from_the_fleets_pace_and_starts_slow(
    rate: Any, table: Any
) -> None:
    r, ai, top = rate.cut(0, 0, 300)
    assert (r, ai, top) == (pytest.approx(300 * DECREASE), 0, 0)
    cut = table({"r": r, "t": T, "ai": ai, "top": top})
    assert rate.admitted_rpm(cut, 0, T + 1000) == pytest.approx(r * SLOW_START)
    assert rate.admitted_rpm(cut, 0, T + 2000) == pytest.approx(r * SLOW_START**2)
    # The slow start stops growing after 30 s without a 429.
    assert rate.admitted_rpm(cut, 0, T + 40_000) == rate.admitted_rpm(cut, 0, T + 30_000)


def test_a_guess_is_never_under_a_request_a_second_nor_a_cut_under_one_a_minute(
    rate: Any,
) -> None:
    assert rate.cut(0, 0, 0)[0] == pytest.approx(60 * DECREASE)
    assert rate.cut(1, 1, 0)[0] == 1


def test_a_ceiling_learned_after_the_cut_caps_the_climb(rate: Any, table: Any) -> None:
    r, ai, top = rate.cut(1200, 1200, 0)
    cut = table({"r": r, "t": T, "ai": ai, "top": top, "lr": 1000})
    ceiling = rate.ceiling_of(0, cut)
    assert rate.admitted_rpm(cut, ceiling, T + 60_000) == 1000
