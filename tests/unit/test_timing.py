"""Deadlines, hint clamping and budgets, decided without waiting."""

from __future__ import annotations

import pytest

from agentq.tools.policy import (
    ToolPolicy,
    effective_limits,
    lost_deadline,
    overran,
    split_meta,
    truncate_text,
)
from tests.helpers import call_scope


def limits(
    timeout_s: float = 120,
    soft: float | None = None,
    max_s: float | None = None,
    hint: float | None = None,
):
    policy = ToolPolicy(timeout_s=timeout_s, soft_timeout_s=soft, budget_s=10, max_timeout_s=max_s)
    return effective_limits(policy, hint)


def test_defaults_soft_is_nine_tenths_of_hard() -> None:
    lim = limits()
    assert (lim.timeout_s, lim.soft_timeout_s) == (120, 108)


def test_hint_is_clamped_to_the_ceiling() -> None:
    assert limits(timeout_s=30, hint=9999).timeout_s == 30
    assert limits(timeout_s=30, max_s=300, hint=9999).timeout_s == 300
    assert limits(timeout_s=30, max_s=300, hint=60).timeout_s == 60


def test_hint_may_shorten_and_soft_follows() -> None:
    lim = limits(timeout_s=30, soft=25, hint=10)
    assert lim.timeout_s == 10 and lim.soft_timeout_s == 9


def test_zero_timeout_means_no_limit_unless_hinted() -> None:
    assert limits(timeout_s=0).timeout_s == 0
    assert limits(timeout_s=0, max_s=0, hint=50).timeout_s == 50


def test_split_meta_strips_and_validates() -> None:
    args, hint, problem = split_meta({"q": 1, "_meta": {"timeout_s": 5}})
    assert args == {"q": 1} and hint == 5 and problem is None
    assert split_meta({"q": 1}) == ({"q": 1}, None, None)
    for bad in ({"timeout_s": -1}, {"timeout_s": "soon"}, {"timeout_s": True}, "x"):
        args, hint, problem = split_meta({"q": 1, "_meta": bad})
        assert args == {"q": 1} and hint is None and problem


def test_lost_deadline_before_and_after_start() -> None:
    kw = dict(timeout_s=2.0, grace_s=1.0, queue_timeout_s=300.0)
    assert lost_deadline(dispatched_at=100.0, started_at=None, **kw) == 401.0
    assert lost_deadline(dispatched_at=100.0, started_at=110.0, **kw) == 113.0
    assert (
        lost_deadline(
            dispatched_at=100.0, started_at=110.0, timeout_s=0, grace_s=1, queue_timeout_s=300
        )
        is None
    )


@pytest.mark.parametrize(
    ("duration", "budget", "expected"), [(5, 10, False), (11, 10, True), (100, 0, False)]
)
def test_overran(duration: float, budget: float, expected: bool) -> None:
    assert overran(duration, budget) is expected


def test_truncate_marks_how_much_was_cut() -> None:
    text, cut = truncate_text("é" * 1000, 500)
    assert cut > 0 and len(text.encode()) <= 500 + 80
    assert f"cut {cut} of 2000 bytes" in text
    assert truncate_text("short", 500) == ("short", 0)


def test_a_soft_limit_the_tool_caught_is_still_seen() -> None:
    # As in a prefork child: billiard's handler raises on the soft limit's signal, the
    # tool catches it and returns early, before its own clock reaches the limit.
    import os
    import signal

    from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
    from celery.exceptions import SoftTimeLimitExceeded

    from agentq.tools.task import _soft_limit

    before = signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
    try:
        with _soft_limit(quiet := call_scope(8.9)):
            pass
        assert not quiet.soft_fired
        with _soft_limit(soft := call_scope(8.9)), pytest.raises(SoftTimeLimitExceeded):
            os.kill(os.getpid(), SIG_SOFT_TIMEOUT)  # its handler runs before this returns
        assert soft.soft_fired
        assert signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler  # restored
        # A limit the pool fired late, for the call this process ran before: not this one's.
        with _soft_limit(stale := call_scope(0.1)):
            os.kill(os.getpid(), SIG_SOFT_TIMEOUT)
        assert not stale.soft_fired
        # Once the tool returned, its result is written whatever the limit says.
        with _soft_limit(after := call_scope(9.5)):
            after.done = True
            os.kill(os.getpid(), SIG_SOFT_TIMEOUT)
        assert not after.soft_fired
        assert signal.getsignal(SIG_SOFT_TIMEOUT) is soft_timeout_sighandler
    finally:
        signal.signal(SIG_SOFT_TIMEOUT, before)
